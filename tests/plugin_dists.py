"""Helpers that build and install throwaway plugin distributions for tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path


def write_dist(root: Path, dist: str, module: str, body: str) -> Path:
    """A minimal plugin distribution: pyproject with an ``atom`` entry point, one module."""
    src = root / dist
    (src / module).mkdir(parents=True)
    (src / module / "__init__.py").write_text(textwrap.dedent(body))
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["setuptools>=61"]
            build-backend = "setuptools.build_meta"
            [project]
            name = "{dist}"
            version = "1.2.3"
            [project.entry-points.atom]
            main = "{module}"
            [tool.setuptools]
            packages = ["{module}"]
            """
        )
    )
    return src


def pip_install(src: Path, target: Path) -> None:
    """Install ``src`` into ``target`` (a directory later put on PYTHONPATH)."""
    build = target.parent / f"build-{src.name}"
    shutil.copytree(src, build)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(build)],
        check=True,
    )


def run_atom(
    args: list[str], pythonpath: Path | None = None, **env: str
) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env)
    if pythonpath is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(pythonpath), os.environ.get("PYTHONPATH")])
        )
    return subprocess.run(
        [sys.executable, "-m", "atom_core.entrypoints.cli", *args],
        capture_output=True, text=True, env=full_env, timeout=300,
    )


def plugins_json(pythonpath: Path | None = None, **env: str) -> list[dict]:
    proc = run_atom(["plugins", "--json"], pythonpath, **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
