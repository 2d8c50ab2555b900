"""docs/writing-a-plugin.md's example is a real package: install it, discover it, run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugin_dists import pip_install, plugins_json, run_atom

EXAMPLE = Path(__file__).parent / "example_plugin"
DOC = Path(__file__).parents[1] / "docs" / "writing-a-plugin.md"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("example") / "site"
    pip_install(EXAMPLE, target)
    return target


@pytest.mark.slow
def test_example_plugin_is_discovered(site: Path):
    reports = {r["name"]: r for r in plugins_json(site)}
    assert reports["atom-mistral-tools"]["registered"] == {"register_tool_formats": ["mistral"]}


@pytest.mark.slow
def test_example_plugin_format_is_served_from_the_registry(site: Path):
    code = (
        "from atom_core.plugins import get_registries\n"
        "fmt = get_registries().tool_formats.get('mistral')()\n"
        "[c] = fmt.parse_region("
        "'[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": 1}}]', at_end=True)\n"
        "print(c.name, c.arguments)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "f {'x': 1}"


@pytest.mark.slow
def test_example_plugin_own_tests_pass(site: Path):
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-c", str(EXAMPLE / "pyproject.toml"), "--confcutdir", str(EXAMPLE),
         str(EXAMPLE / "tests")],
        capture_output=True, text=True, env=env, cwd=EXAMPLE,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed" in proc.stdout


def test_doc_shows_the_example_code_verbatim():
    doc = DOC.read_text()
    for rel in ("pyproject.toml", "atom_mistral_tools/hooks.py", "tests/test_mistral_tools.py"):
        assert (EXAMPLE / rel).read_text().strip() in doc, f"{rel} drifted from the doc"


def test_cli_rejects_unknown_command():
    assert run_atom(["nope"]).returncode == 2
