"""Each plugin's tests collect from a copy outside the repository, beside the installed
atom-core alone: they may use atom_core.testing, never this checkout's tests package or
files. scripts/test_plugins_standalone.sh runs them in full the same way."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
PLUGIN_DIRS = sorted(p for p in PLUGINS.iterdir() if (p / "pyproject.toml").is_file())
BUILD_LEFTOVERS = shutil.ignore_patterns("*.egg-info", "__pycache__", ".pytest_cache", "build")


@pytest.mark.slow
@pytest.mark.parametrize("plugin", PLUGIN_DIRS, ids=[p.name for p in PLUGIN_DIRS])
def test_plugin_tests_collect_outside_the_repository(plugin: Path, tmp_path: Path):
    copy = tmp_path / plugin.name
    shutil.copytree(plugin, copy, ignore=BUILD_LEFTOVERS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=copy, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = re.search(r"(\d+) tests? collected", proc.stdout)
    assert collected and int(collected.group(1)) > 0, proc.stdout[-3000:]
