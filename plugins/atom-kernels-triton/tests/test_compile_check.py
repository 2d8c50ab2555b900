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
    """Two tiles each of 64 and 128 rows, where Triton 3.6 failed before the decoded weights
    became the dot's left operand (a failure exits 1 and names the error on its line)."""
    out = run("--arch", "90", "--block-m", "64", "--limit", "2", cache=tmp_path)
    more = run("--arch", "90", "--block-m", "128", "--limit", "2", cache=tmp_path)
    for o in (out, more):
        assert o.returncode == 0, o.stdout + o.stderr
        lines = [line for line in o.stdout.splitlines() if line.startswith("_")]
        assert len(lines) == 4 and all(line.endswith(": ok") for line in lines)
        assert "sm_90, bf16: 0 failed" in o.stdout
    assert "'BLOCK_M': 64" in out.stdout and "'BLOCK_M': 128" in more.stdout


def test_refuses_the_interpreter():
    out = run("--limit", "1", interpret=True)
    assert out.returncode != 0 and "TRITON_INTERPRET" in out.stderr
