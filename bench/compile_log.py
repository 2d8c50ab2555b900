"""The Triton kernels a bench's timed part compiled: ``CompileLog``.

A Triton kernel compiles at its first launch with a new specialization, and every step of
an engine waits for it. A bench that times a run lists what compiled inside the timing, so
a figure that paid for compiles says so, and the warm-up that should have built them can
be told which.
"""

from __future__ import annotations

import time
from typing import Any


class CompileLog:
    """The Triton kernels compiled (or loaded from Triton's on-disk cache) while the block
    runs, through Triton's ``jit_cache_hook`` and ``jit_post_compile_hook``: each one's
    kernel, milliseconds from the request to its binary, launch options, and the
    specialization that made it a new variant (constexpr values, and which integer and
    pointer arguments were specialized: equal to 1, divisible by 16). A timed run that
    lists any paid for them with every step waiting. Records nothing where triton is not
    installed; the hooks in place before are restored on exit."""

    def __enter__(self) -> CompileLog:
        self.compiles: list[dict[str, Any]] = []
        self._started: dict[tuple[str, str], float] = {}
        try:
            from triton import knobs
        except ImportError:
            self._knobs = None
            return self
        self._knobs = knobs.runtime
        self._saved = (self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook)
        self._knobs.jit_cache_hook = self.before
        self._knobs.jit_post_compile_hook = self.after
        return self

    def __exit__(self, *exc: object) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._saved

    def before(self, *, key: Any, fn: Any, **_: Any) -> bool:
        self._started[(fn.name, str(key))] = time.perf_counter()
        return False  # compile it: True would tell Triton to skip the kernel

    def after(self, *, key: Any, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        start = self._started.pop((fn.name, str(key)), None)
        configs = compile.get("configs") or [{}]
        self.compiles.append({
            "kernel": fn.name,
            "ms": None if start is None else (time.perf_counter() - start) * 1e3,
            "num_warps": compile.get("num_warps"), "num_stages": compile.get("num_stages"),
            "constants": {str(k): repr(v) for k, v in (compile.get("constants") or {}).items()},
            "specialized": {str(k): repr(v) for k, v in configs[0].items()},
        })
        return False

    def summary(self) -> str:
        """One line: how many, and the seconds they took."""
        ms = sum(c["ms"] or 0.0 for c in self.compiles)
        return f"{len(self.compiles)} Triton kernels compiled or loaded ({ms / 1e3:.2f} s)"
