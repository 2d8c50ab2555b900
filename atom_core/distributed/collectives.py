"""The collectives the parallel layers call: identities in a group of one."""

from __future__ import annotations

import torch
import torch.distributed as dist

from atom_core.distributed.state import tensor_parallel


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the tensor-parallel ranks (in place; returns ``x``)."""
    tp = tensor_parallel()
    if tp.size > 1 and not tp.dp_attention:
        dist.all_reduce(x, group=tp.group)
    return x


def min_over_ranks(value: int) -> int:
    """The least of the tensor-parallel ranks' ``value`` (over the control group: a host
    number, and no data collective that a rank could be capturing)."""
    tp = tensor_parallel()
    if tp.size == 1 or tp.dp_attention:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.control)
    return int(t)


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' ``x`` side by side along the last dimension, rank 0 first."""
    tp = tensor_parallel()
    if tp.size == 1 or tp.dp_attention:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


# How many gather_rows calls this process made: DP attention's lockstep counts a step's.
row_exchanges = 0

# What gather_rows's header can name: the dtypes activations and routing choices come in.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)


def gather_rows(*xs: torch.Tensor | None) -> tuple[list[torch.Tensor], list[int]]:
    """DP attention: every rank's rows of each of ``xs`` (2-D, same row count within a
    rank, any count across ranks), concatenated rank 0 first; and each rank's row count.
    A rank with no rows passes None for each (it need not know their widths or dtypes: a
    header from the other ranks says them). Padded to the largest count for one all-gather
    per tensor."""
    global row_exchanges
    row_exchanges += 1
    tp = tensor_parallel()
    header = [0]
    for x in xs:
        if x is None:
            header += [-1, 0]
        else:
            header[0] = x.shape[0]
            header += [_DTYPES.index(x.dtype), x.shape[1]]
    mine = torch.tensor(header, dtype=torch.long)
    headers = [torch.empty_like(mine) for _ in range(tp.size)]
    dist.all_gather(headers, mine, group=tp.group)
    sizes = [int(h[0]) for h in headers]
    width = max(sizes)
    some = max(headers, key=lambda h: int(h[0])).tolist()  # a rank that has rows
    device = next((x.device for x in xs if x is not None), torch.device("cpu"))
    gathered = []
    for i, x in enumerate(xs):
        dtype, cols = _DTYPES[some[1 + 2 * i]], some[2 + 2 * i]
        padded = torch.zeros(width, cols, dtype=dtype, device=device)
        if x is not None:
            padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(tp.size)]
        dist.all_gather(parts, padded, group=tp.group)
        gathered.append(torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]))
    return gathered, sizes


def sum_own_rows(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """DP attention: ``x`` [sum(sizes), ...] summed over the ranks, this rank's rows of it
    (those ``gather_rows`` took from it)."""
    tp = tensor_parallel()
    dist.all_reduce(x, group=tp.group)
    start = sum(sizes[: tp.rank])
    return x[start: start + sizes[tp.rank]]
