"""Each plugin's tests collect from a copy outside the repository, beside the installed
atom-core alone: they may use atom_core.testing, never this checkout's tests package or
files. scripts/test_plugins_standalone.sh runs them in full the same way."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
PLUGIN_DIRS = sorted(p for p in PLUGINS.iterdir() if (p / "pyproject.toml").is_file())
BUILD_LEFTOVERS = shutil.ignore_patterns("*.egg-info", "__pycache__", ".pytest_cache", "build")


@pytest.mark.slow
def test_plugin_tests_collect_outside_the_repository(tmp_path: Path):
    # One collection over all the copies: a process per plugin cost ~5 s each in imports.
    for plugin in PLUGIN_DIRS:
        shutil.copytree(plugin, tmp_path / plugin.name, ignore=BUILD_LEFTOVERS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "--import-mode=importlib", "--rootdir", str(tmp_path),
         *(f"{p.name}/tests" for p in PLUGIN_DIRS)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = Counter(line.split("/", 1)[0] for line in proc.stdout.splitlines()
                        if "::" in line)
    assert all(collected[p.name] > 0 for p in PLUGIN_DIRS), (collected, proc.stdout[-3000:])
