"""The clamped_swiglu_moe reference against transformers' GptOssExperts on the same weights,
as model-dtype stacks and as MXFP4 stacks (transformers given them dequantized by its own
integrations/mxfp4.py)."""

import torch
from transformers import GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from atom_core.ops import resolve_op
from atom_core.quant.mxfp4 import Mxfp4Weight, quantize

EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = 4, 64, 32, 2, 9


def hf_experts(seed: int = 0) -> GptOssExperts:
    cfg = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                       swiglu_limit=3.0)  # a limit the random products reach: clamps matter
    torch.manual_seed(seed)
    experts = GptOssExperts(cfg)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.5)
    return experts.eval()


def routing(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    return torch.rand(TOKENS, TOP_K, generator=g).softmax(-1), ids


def test_matches_transformers_experts():
    hf, (weights, ids) = hf_experts(), routing()
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        ref = hf(x, ids, weights)
    op = resolve_op("clamped_swiglu_moe", "cpu")
    # HF stores [E, K, N]; the op takes [E, N, K], as F.linear does.
    got = op(x, hf.gate_up_proj.data.transpose(1, 2), hf.gate_up_proj_bias.data,
             hf.down_proj.data.transpose(1, 2), hf.down_proj_bias.data, weights, ids,
             hf.alpha, hf.limit)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_mxfp4_stacks_match_transformers_on_the_dequantized_weights():
    hf, (weights, ids) = hf_experts(2), routing(3)
    w13 = Mxfp4Weight(*quantize(hf.gate_up_proj.data.transpose(1, 2)))
    w2 = Mxfp4Weight(*quantize(hf.down_proj.data.transpose(1, 2)))
    with torch.no_grad():
        for param, w in ((hf.gate_up_proj, w13), (hf.down_proj, w2)):
            blocks = w.blocks.view(*w.scales.shape, 16)  # the checkpoint's shape
            param.copy_(convert_moe_packed_tensors(blocks, w.scales, dtype=torch.float32))
    x = torch.randn(TOKENS, HIDDEN)
    ids[0, 1] = -1  # a slot another rank owns: skipped
    keep = ids >= 0
    with torch.no_grad():
        ref = hf(x, ids.clamp(min=0), weights * keep)
    got = resolve_op("clamped_swiglu_moe", "cpu")(
        x, w13, hf.gate_up_proj_bias.data, w2, hf.down_proj_bias.data, weights, ids,
        hf.alpha, hf.limit)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_bf16_activations_dequantize_to_bf16():
    """Weight-only: bf16 rows times the weight dequantized to bf16 (exact), bf16 out."""
    hf, (weights, ids) = hf_experts(), routing()
    w13 = Mxfp4Weight(*quantize(hf.gate_up_proj.data.transpose(1, 2)))
    w2 = Mxfp4Weight(*quantize(hf.down_proj.data.transpose(1, 2)))
    x = torch.randn(TOKENS, HIDDEN).bfloat16()
    op = resolve_op("clamped_swiglu_moe", "cpu")
    got = op(x, w13, None, w2, None, weights, ids, hf.alpha, hf.limit)
    ref = op(x.float(), w13, None, w2, None, weights, ids, hf.alpha, hf.limit)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=0.1, rtol=0.02)
