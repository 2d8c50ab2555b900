"""The core's FusedMoE layer with shared experts folded into always-selected slots, run by the
Triton fused-MoE op (through the interpreter on CPU): the native op's output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from atom_kernels_triton.fused_moe import fused_moe as triton_fused_moe  # noqa: E402
from atom_kernels_triton.fused_moe_config import MoeConfig  # noqa: E402
from triton_reference import rel_err, tolerance  # noqa: E402

from atom_core.layers.moe import FusedMoE, load_hf_moe_weights  # noqa: E402
from atom_core.testing.op_cases import moe_checkpoint  # noqa: E402

NUM_EXPERTS, HIDDEN, INTER, TOP_K, SHARED = 6, 16, 8, 2, 2


def checkpoint(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    return moe_checkpoint(NUM_EXPERTS, HIDDEN, INTER, SHARED, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_op_matches_native_with_the_shared_slots(dtype):
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.experts = FusedMoE(NUM_EXPERTS, HIDDEN, INTER, num_shared_experts=SHARED)
    load_hf_moe_weights(model, checkpoint())
    layer = model.mlp.experts.to(dtype)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, HIDDEN, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K] for _ in range(7)])
    topk_weights = torch.rand(7, TOP_K, generator=g) * 2.5
    native = layer(x, topk_weights, ids)
    tiny = MoeConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)
    layer._op = lambda *args, **kwargs: triton_fused_moe(*args, **kwargs, config=tiny)
    got = layer(x, topk_weights, ids)
    assert got.dtype == dtype and rel_err(got, native) < tolerance(dtype)
