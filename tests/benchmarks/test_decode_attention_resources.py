"""bench/decode_attention_resources.py: decode attention's variants compiled for sm_90 by the
installed Triton, with no GPU. A subprocess, since the plugin tests' conftest runs kernels
through the interpreter, which does not compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
BENCH = Path(__file__).resolve().parents[2] / "bench" / "decode_attention_resources.py"


def run(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(BENCH), *args], env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow
def test_pointer_and_tma_variants_compile_for_sm90(tmp_path):
    out = run("--cache", "fp8", "--tile", "32x4x3", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads((tmp_path / "r.json").read_text())["variants"]
    assert [(r["fused_input"], r["tma"]) for r in rows] == [
        (True, False), (True, True), (False, False), (False, True)]
    for r in rows:
        assert r["tile"] == [32, 4, 3] and r["cache"] == "fp8"
        assert 0 < r["registers"] <= 255 and r["programs_per_sm"] >= 1
        assert r["shared_bytes"] > 0 and r["sass_instructions"] > 100
    assert "| fp8 | 32x4x3 | yes | TMA |" in out.stdout


def test_refuses_the_interpreter_and_bad_tiles():
    out = run("--cache", "fp8", interpret=True)
    assert out.returncode != 0 and "TRITON_INTERPRET" in out.stderr
    out = run("--tile", "32x4")
    assert out.returncode == 2 and "BLOCK_NxWARPSxSTAGES" in out.stderr
