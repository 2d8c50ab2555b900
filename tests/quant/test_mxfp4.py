"""The MXFP4 format: dequantized as transformers' integrations/mxfp4.py reads a checkpoint,
quantized to the nearest value, and the activations' bound read from the environment."""

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from atom_core.errors import ConfigError
from atom_core.quant.mxfp4 import (
    BF16_BOUND_ENV,
    FP4_VALUES,
    Mxfp4Weight,
    bf16_bound,
    dequantize,
    quantize,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_reads_checkpoint_bytes_as_transformers_does(dtype):
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 8, 4), dtype=torch.uint8, generator=g)
    # transformers returns the stack transposed, [E, K, N], the way its experts multiply.
    ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    weight = Mxfp4Weight(blocks.flatten(-2), scales)
    assert weight.shape == (3, 8, 128)
    got = weight.dequantize(dtype)
    assert got.dtype == dtype and torch.equal(got, ref)
    assert torch.equal(weight.expert(1).dequantize(dtype), ref[1])


def test_quantize_rounds_to_the_nearest_value_of_the_groups_scale():
    w = torch.randn(5, 64) * torch.logspace(-3, 3, 5)[:, None]
    blocks, scales = quantize(w)
    assert blocks.shape == (5, 32) and scales.shape == (5, 2)
    got = dequantize(blocks, scales)
    factors = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)
    grid = torch.tensor(FP4_VALUES)[None, None, :] * factors[..., None]
    nearest = (w[..., None] - grid).abs().min(dim=-1).values
    torch.testing.assert_close((got - w).abs(), nearest, atol=0, rtol=0)
    # The scale leaves each group's largest magnitude within e2m1's range, not past it.
    assert ((w.abs().view(5, 2, 32).amax(-1) / factors[:, ::32]) <= 6.0).all()
    assert torch.equal(dequantize(*quantize(got)), got)  # MXFP4 values are kept as they are


def test_bf16_bound_from_the_environment(monkeypatch):
    monkeypatch.delenv(BF16_BOUND_ENV, raising=False)
    assert bf16_bound() == 256
    monkeypatch.setenv(BF16_BOUND_ENV, "64")
    assert bf16_bound() == 64
    for bad in ("0", "many"):
        monkeypatch.setenv(BF16_BOUND_ENV, bad)
        with pytest.raises(ConfigError, match=BF16_BOUND_ENV):
            bf16_bound()
