"""A bad --model given to ``atom serve`` is one clear line on stderr and a non-zero exit,
with no traceback, whether the frontend finds it before anything starts or the engine
process finds it while loading."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from atom_core.entrypoints.server_process import free_port
from atom_core.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow


def broken_copy(tmp_path: Path, breakage: str) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    if breakage == "corrupt config":
        (model / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    elif breakage == "truncated weights":
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif breakage == "weights of another shape":  # found by the engine process, while loading
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    return model


CASES = {
    "missing path": (lambda tmp: tmp / "no" / "such" / "path", "does not exist"),
    "empty directory": (lambda tmp: tmp, "without a config.json"),
    "corrupt config": (lambda tmp: broken_copy(tmp, "corrupt config"),
                       "cannot read a model config"),
    "truncated weights": (lambda tmp: broken_copy(tmp, "truncated weights"),
                          "model.safetensors is not a readable"),
    "weights of another shape": (lambda tmp: broken_copy(tmp, "weights of another shape"), "lacks"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_model_is_one_line_and_a_nonzero_exit(tmp_path, case):
    make, says = CASES[case]
    model = make(tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "atom_core.entrypoints.server_runtime", "--model", str(model),
         "--host", "127.0.0.1", "--server-port", str(free_port())],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr + run.stdout, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("atom serve: error:")]
    assert len(errors) == 1, run.stderr
    names_model = str(model) in errors[0] or case == "weights of another shape"
    assert says in errors[0] and names_model, errors[0]
