"""How many programs of a compiled kernel the GPU holds at once (for persistent launches).

A persistent kernel whose programs wait on one another (``fused_moe``'s experts kernel)
must never launch more programs than fit on the GPU together: a waiting program holds its
slot, and a program that never got one would never arrive. The bound comes from the
compiled kernel's registers and shared memory against one SM's, as the CUDA occupancy
calculator counts them (registers per warp rounded up to 256, 1 KiB of shared memory
reserved per block), times the SMs. Registers differ between specializations of one kernel
(Triton compiles one per pattern of 16-byte-aligned pointers and of integers equal to 1 or
divisible by 16), so the bound is cached per specialization, never shared between them.
A bound from the most registers a thread can have (255) would be safe too, but holds
DeepSeek-V2-Lite's batch-1 experts kernel to 2 programs an SM, slowing its decode step.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch
import triton

RESERVED_SMEM_PER_BLOCK = 1024
_cache: dict[tuple, int] = {}


def sm_limits(capability: tuple[int, int]) -> tuple[int, int]:
    """(warps, blocks) one SM holds at once, which the driver's properties do not list: sm80,
    sm90 and sm100 hold 64 warps and 32 blocks; the others 48 and 16 (sm89 24: 16 is the safe
    side)."""
    return (64, 32) if capability in ((8, 0), (9, 0), (10, 0)) else (48, 16)


def _specialization(arg: Any) -> Any:
    """What Triton specializes a kernel on for one argument (its default ``do_not_specialize``-free
    rules): a tensor's dtype and 16-byte alignment, an integer's being 1 or a multiple of 16 and
    whether it needs 64 bits."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int) and not isinstance(arg, bool):
        return int, arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31
    return type(arg)


class DeviceLimits(NamedTuple):
    sms: int
    smem_per_block: int  # bytes of shared memory a block may opt into
    tma: bool  # the bulk tensor copy engine (NVIDIA sm_90 on): Triton's descriptor loads


@functools.cache
def device_limits(device: torch.device) -> DeviceLimits:
    """A CUDA device's SM count, per-block shared memory and TMA: the one device query the
    kernels' grid and tile rules read (cached; never queried during a graph capture)."""
    props = torch.cuda.get_device_properties(device)
    tma = torch.version.hip is None and props.major >= 9
    return DeviceLimits(props.multi_processor_count, props.shared_memory_per_block_optin, tma)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def programs_per_sm(
    n_regs: int, shared: int, num_warps: int, regs_per_sm: int, smem_per_sm: int,
    capability: tuple[int, int] = (9, 0)
) -> int:
    """Blocks of one kernel an SM holds at once (at least 1: a kernel that compiled fits once)."""
    max_warps, max_blocks = sm_limits(capability)
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_smem = smem_per_sm // (shared + RESERVED_SMEM_PER_BLOCK)
    return max(1, min(by_regs, by_smem, max_warps // num_warps, max_blocks))


def resident_programs(kernel: Any, args: tuple, consts: dict[str, Any], per_sm_cap: int) -> int:
    """Programs of ``kernel`` (a ``triton.jit`` function) launched with ``args`` and ``consts``
    that run at once on the args' GPU, at most ``per_sm_cap`` per SM. 1 under the interpreter,
    which runs programs one after another."""
    tensor = next(a for a in args if isinstance(a, torch.Tensor))
    if _interpreted() or tensor.device.type != "cuda":
        return 1
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    signature = tuple(_specialization(a) for a in args)
    key = (kernel, index, tuple(sorted(consts.items())), signature, per_sm_cap)
    if key not in _cache:
        compiled = kernel.warmup(*args, grid=(1,), **consts)
        compiled._init_handles()
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        per_sm = programs_per_sm(
            compiled.n_regs, compiled.metadata.shared, consts.get("num_warps", 4),
            props["max_num_regs"], props["max_shared_mem"], torch.cuda.get_device_capability(index),
        )
        _cache[key] = props["multiprocessor_count"] * min(per_sm, per_sm_cap)
    return _cache[key]
