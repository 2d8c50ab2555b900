"""--mark-trace: one gzip Chrome trace per CUDA-graph capture iteration.

Each file covers the warm-up forward and the capture of one batch size: inside
``torch.cuda.graph`` kernels are recorded, not run, so the warm-up is where the GPU track
has its kernels. Files: ``{profiler_dir}/capture_traces/bs_<bs>_q_<max_q_len>_rank<rank>.json.gz``.
"""

from __future__ import annotations

import gzip
import os
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

from torch.profiler import ProfilerActivity, profile


class CaptureTracer:
    def __init__(self, profiler_dir: str | None, rank: int = 0) -> None:
        self.dir = Path(profiler_dir) / "capture_traces" if profiler_dir else None
        self.rank = rank

    def path(self, bs: int, max_q_len: int = 1) -> Path:
        assert self.dir is not None
        return self.dir / f"bs_{bs}_q_{max_q_len}_rank{self.rank}.json.gz"

    def trace(self, bs: int, max_q_len: int = 1) -> AbstractContextManager[None]:
        """Profile the block (warm-up + capture of one size) into its own file."""
        return self._trace(bs, max_q_len) if self.dir is not None else nullcontext()

    @contextmanager
    def _trace(self, bs: int, max_q_len: int) -> Iterator[None]:
        more = os.environ.get("ATOM_PROFILER_MORE") == "1"
        self.dir.mkdir(parents=True, exist_ok=True)
        with profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
            record_shapes=more, with_stack=more, profile_memory=more,
        ) as prof:
            yield
        target = self.path(bs, max_q_len)
        raw = target.with_suffix("")  # .json
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
