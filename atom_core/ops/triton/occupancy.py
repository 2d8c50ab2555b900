"""How many programs of a compiled kernel the GPU holds at once (for persistent launches).

A persistent kernel whose programs wait on one another (``fused_moe``'s experts kernel)
must never launch more programs than fit on the GPU together: a waiting program holds its
slot, and a program that never got one would never arrive. The bound comes from the
compiled kernel's registers and shared memory against one SM's, as the CUDA occupancy
calculator counts them (registers per warp rounded up to 256, 1 KiB of shared memory
reserved per block), times the SMs.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton

# Per-SM limits of sm80-sm100 that the driver's properties do not list.
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
RESERVED_SMEM_PER_BLOCK = 1024

_cache: dict[tuple, int] = {}


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def programs_per_sm(n_regs: int, shared: int, num_warps: int, regs_per_sm: int, smem_per_sm: int) -> int:
    """Blocks of one kernel an SM holds at once (at least 1: a kernel that compiled fits once)."""
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_smem = smem_per_sm // (shared + RESERVED_SMEM_PER_BLOCK)
    return max(1, min(by_regs, by_smem, MAX_WARPS_PER_SM // num_warps, MAX_BLOCKS_PER_SM))


def resident_programs(kernel: Any, args: tuple, consts: dict[str, Any], per_sm_cap: int) -> int:
    """Programs of ``kernel`` (a ``triton.jit`` function) launched with ``args`` and ``consts``
    that run at once on the args' GPU, at most ``per_sm_cap`` per SM. 1 under the interpreter,
    which runs programs one after another."""
    tensor = next(a for a in args if isinstance(a, torch.Tensor))
    if _interpreted() or tensor.device.type != "cuda":
        return 1
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    signature = tuple(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args)
    key = (kernel, index, tuple(sorted(consts.items())), signature, per_sm_cap)
    if key not in _cache:
        compiled = kernel.warmup(*args, grid=(1,), **consts)
        compiled._init_handles()
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        per_sm = programs_per_sm(
            compiled.n_regs, compiled.metadata.shared, consts.get("num_warps", 4),
            props["max_num_regs"], props["max_shared_mem"],
        )
        _cache[key] = props["multiprocessor_count"] * min(per_sm, per_sm_cap)
    return _cache[key]
