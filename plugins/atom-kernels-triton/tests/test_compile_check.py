"""``python -m atom_kernels_triton.compile_check``: gpt-oss's expert kernels compiled for
sm_90 by the installed Triton, with no GPU. A subprocess, since this folder's conftest runs
the kernels through the interpreter, which does not compile."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def run(*args: str, interpret: bool = False, cache=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if cache is not None:  # compile afresh: Triton's cache would answer from earlier runs
        env["TRITON_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, "-m", "atom_kernels_triton.compile_check", *args],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_tiles_of_64_and_128_rows_compile_for_sm90(tmp_path):
    """A tile of 64 rows and one of 128, where Triton 3.6 failed before the decoded weights
    became the dot's left operand (a failure exits 1 and names the error on its line)."""
    for block_m in ("64", "128"):
        out = run("--arch", "90", "--block-m", block_m, "--limit", "1", cache=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        lines = [line for line in out.stdout.splitlines() if line.startswith("_")]
        assert len(lines) == 2 and all(line.endswith(": ok") for line in lines)
        assert all(f"'BLOCK_M': {block_m}," in line for line in lines)
        assert "sm_90, bf16: 0 failed" in out.stdout
    # A target that ptxas refuses these kernels for (sm_70) counts as failed, and says so.
    out = run("--arch", "70", "--limit", "1", cache=tmp_path)
    assert out.returncode == 1 and "sm_70, bf16: 2 failed" in out.stdout


def test_refuses_the_interpreter():
    out = run("--limit", "1", interpret=True)
    assert out.returncode != 0 and "TRITON_INTERPRET" in out.stderr
