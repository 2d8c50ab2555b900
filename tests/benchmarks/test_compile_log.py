"""bench/compile_log.py on CPU: its hooks called as Triton calls them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from compile_log import CompileLog  # noqa: E402


def test_compile_log_records_each_kernel_and_restores_the_hooks():
    knobs = pytest.importorskip("triton").knobs.runtime
    before = (knobs.jit_cache_hook, knobs.jit_post_compile_hook)
    kernel = type("Info", (), {"name": "_decode_kernel"})()
    compile = {"num_warps": 4, "num_stages": 2, "constants": {("NUM_SPLITS",): 1},
               "configs": [{(3,): [["tt.divisibility", 16]]}]}
    with CompileLog() as log:
        assert knobs.jit_cache_hook == log.before
        assert knobs.jit_cache_hook(key="k", fn=kernel, repr="") is False  # compile it
        assert knobs.jit_post_compile_hook(key="k", fn=kernel, compile=compile) is False
        # A cache load is reported after, with no request before it.
        knobs.jit_post_compile_hook(key="j", fn=kernel, compile={})
    assert (knobs.jit_cache_hook, knobs.jit_post_compile_hook) == before
    first, second = log.compiles
    assert first["kernel"] == "_decode_kernel" and first["ms"] >= 0
    assert first["num_warps"] == 4 and first["constants"] == {"('NUM_SPLITS',)": "1"}
    assert first["specialized"] == {"(3,)": "[['tt.divisibility', 16]]"}
    assert second["ms"] is None and second["constants"] == {}
    assert log.summary().startswith("2 Triton kernels compiled or loaded (")
