"""Rotary position embedding applied from a precomputed cos/sin cache."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rot_dim`` dims of each head of query/key ([T, heads*head_size], or
    [T, heads, head_size]: new tensors of the same shapes).

    ``cos_sin_cache`` is [max_position, rot_dim] holding cos in the first half, sin in the
    second; computation is fp32, results are in the inputs' dtype.
    """
    cos_sin = cos_sin_cache.index_select(0, positions.flatten())
    rot_dim = cos_sin.shape[-1]
    cos, sin = cos_sin.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = []
    for x in (query, key):
        shape = x.shape
        xh = x.reshape(shape[0], -1, head_size)
        rot = _rotate(xh[..., :rot_dim].float(), cos, sin, is_neox).to(x.dtype)
        xh = torch.cat((rot, xh[..., rot_dim:]), dim=-1) if rot_dim < head_size else rot
        out.append(xh.reshape(shape))
    return out[0], out[1]
