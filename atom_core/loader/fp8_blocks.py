"""Block-quantized FP8 checkpoints (DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8), read dequantized.

Such a checkpoint's ``config.json`` carries ``quantization_config`` with ``quant_method:
"fp8"`` and ``weight_block_size`` [bn, bk]: each quantized linear's ``X.weight`` is
float8_e4m3fn and ``X.weight_scale_inv`` holds one fp32 scale per bn x bk block (the
value is ``weight * scale_inv``; activations are quantized dynamically, so there are no
input scales). Norms, embeddings, routers and the LM head stay in bf16.

The loader reads each quantized weight as the dequantized fp32 tensor, which the model's
weight loaders copy into its dtype (as GGUF is read): the model runs in bf16, so such a
checkpoint takes twice its disk size in memory. A quantization method or layout other than
this one is refused by name.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from atom_core.errors import ConfigError

logger = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(hf_config: Any) -> tuple[int, int] | None:
    """The checkpoint's FP8 block size, None for an unquantized checkpoint; an unsupported
    ``quantization_config`` is a ConfigError naming it."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    method = quant.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported; "
                          "ATOM reads unquantized and block-FP8 ('fp8' with "
                          "weight_block_size) checkpoints")
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError("an 'fp8' quantization_config without weight_block_size [n, k] "
                          f"(per-tensor FP8, got {block!r}) is not supported; ATOM reads "
                          "block-FP8 checkpoints")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"fp8 format {fmt!r} is not supported (block-FP8 checkpoints are "
                          "e4m3)")
    return int(block[0]), int(block[1])


def dequantize_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                     block: tuple[int, int]) -> torch.Tensor:
    """fp32 ``weight * scale_inv`` with one scale per ``block`` tile of the [N, K] weight
    (the last row and column of tiles may be partial)."""
    n, k = weight.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    if tuple(scale_inv.shape) != (rows, cols):
        raise ConfigError(f"a weight of shape {(n, k)} in {block} blocks needs "
                          f"{(rows, cols)} scales, the checkpoint has {tuple(scale_inv.shape)}")
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:n]
    return weight.float() * scales.repeat_interleave(block[1], 1)[:, :k]


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int],
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each FP8 ``X.weight`` and its ``X.weight_scale_inv`` replaced by the
    dequantized fp32 ``X.weight``; the other tensors pass through. A weight without its
    scale, or a scale without its weight, is an error."""
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    count = 0
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            target = name[: -len(SCALE_SUFFIX)]
            if target in weights_waiting:
                count += 1
                yield target, dequantize_block(weights_waiting.pop(target), tensor, block)
            else:
                scales_waiting[target] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            if name in scales_waiting:
                count += 1
                yield name, dequantize_block(tensor, scales_waiting.pop(name), block)
            else:
                weights_waiting[name] = tensor
        else:
            yield name, tensor
    if weights_waiting or scales_waiting:
        lone = sorted(weights_waiting) + sorted(f"{n}{SCALE_SUFFIX}" for n in scales_waiting)
        raise ConfigError(f"block-FP8 checkpoint: {len(lone)} tensors without their pair "
                          f"(weight and {SCALE_SUFFIX}): {', '.join(lone[:5])}")
    logger.info("block-FP8 checkpoint: %d weights dequantized at load (FP8 compute is not "
                "built: the model runs in its --dtype)", count)
