"""FP8 checkpoints, read dequantized: the layouts of published FP8 weights.

A checkpoint's ``config.json`` names its method in ``quantization_config``; each quantized
linear's ``X.weight`` is float8_e4m3fn beside an fp32/bf16 scale tensor, and the value is
``weight * scale`` broadcast over the scale's granularity:
- ``quant_method: "fp8"`` with ``weight_block_size`` [bn, bk] (DeepSeek-V3/R1, Kimi-K2,
  Qwen3-FP8): ``X.weight_scale_inv``, one scale per bn x bk block; activations dynamic.
- ``quant_method: "fp8"`` without it (vLLM's and AutoFP8's per-tensor checkpoints):
  ``X.weight_scale``, one scale per tensor, and with ``activation_scheme: "static"`` an
  ``X.input_scale``.
- ``quant_method: "compressed-tensors"``, ``format: "float-quantized"`` (llm-compressor's
  FP8, e.g. the ``-FP8-dynamic`` and ``-FP8`` checkpoints on the Hub): ``X.weight_scale``
  per tensor, per output channel ([N, 1]) or per block (``block_structure``); weights
  8-bit floats, symmetric and static; activations dynamic per token, static per tensor
  (``X.input_scale``) or not quantized (W8A16).

The loader reads each quantized weight as the dequantized fp32 tensor, which the model's
weight loaders copy into its dtype (as GGUF is read); where the device computes in FP8 the
model is then quantized again as ``--quantization fp8`` does (weights per output channel,
activations per token; ``loader.load_model``), else it runs in ``--dtype``. Static
activation scales are therefore not used, and dropped.
Norms, embeddings, routers and the LM head stay as shipped. A method or layout other than
these is refused by name.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from atom_core.errors import ConfigError

logger = logging.getLogger(__name__)

INPUT_SCALE = "input_scale"  # a static activation scale (per tensor), unused
SUPPORTED = ("'fp8' (per block or per tensor) and compressed-tensors 'float-quantized' "
             "FP8 checkpoints")


@dataclass(frozen=True)
class Fp8Layout:
    """How a checkpoint stores its FP8 weights."""

    method: str  # quantization_config's quant_method, for messages
    scale_name: str  # X.weight's scale is X.<scale_name>
    block: tuple[int, int] | None  # a 2-D scale's tile; per tensor or channel by its shape


def fp8_layout(hf_config: Any) -> Fp8Layout | None:
    """The checkpoint's FP8 layout, None for an unquantized checkpoint; an unsupported
    ``quantization_config`` is a ConfigError naming it."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    method = quant.get("quant_method")
    if method == "fp8":
        return _fp8(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    raise ConfigError(f"quantization_config.quant_method {method!r} is not supported; ATOM "
                      f"reads unquantized checkpoints and {SUPPORTED}")


def _block(value: Any, what: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(b, int) and b > 0 for b in value)):
        raise ConfigError(f"{what} {value!r} is not a block shape [n, k]")
    return int(value[0]), int(value[1])


def _fp8(quant: dict[str, Any]) -> Fp8Layout:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"fp8 format {fmt!r} is not supported (FP8 checkpoints are e4m3)")
    block = quant.get("weight_block_size")
    if block is None:
        return Fp8Layout("fp8", "weight_scale", None)
    return Fp8Layout("fp8", "weight_scale_inv", _block(block, "weight_block_size"))


def _compressed_tensors(quant: dict[str, Any]) -> Fp8Layout:
    fmt = quant.get("format")
    if fmt != "float-quantized":
        raise ConfigError(f"compressed-tensors format {fmt!r} is not supported; ATOM reads "
                          f"{SUPPORTED}")
    if quant.get("sparsity_config"):
        raise ConfigError("compressed-tensors with a sparsity_config is not supported; ATOM "
                          "reads dense FP8 weights")
    groups = quant.get("config_groups") or {}
    if not groups:
        raise ConfigError("compressed-tensors quantization_config has no config_groups")
    blocks = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if not (weights.get("type") == "float" and weights.get("num_bits") == 8):
            raise ConfigError(f"compressed-tensors group {name!r}: weights of type "
                              f"{weights.get('type')!r} with {weights.get('num_bits')!r} bits "
                              "are not supported; ATOM reads 8-bit float (FP8) weights")
        if not weights.get("symmetric", True) or weights.get("dynamic", False):
            raise ConfigError(f"compressed-tensors group {name!r}: FP8 weights must be "
                              "symmetric and static")
        strategy = weights.get("strategy")
        if strategy == "block":
            blocks.add(_block(weights.get("block_structure"), f"group {name!r} block_structure"))
        elif strategy not in ("tensor", "channel"):
            raise ConfigError(f"compressed-tensors group {name!r}: weight strategy "
                              f"{strategy!r} is not supported (tensor, channel or block)")
        acts = group.get("input_activations")
        if acts is not None and not (acts.get("type") == "float" and acts.get("num_bits") == 8):
            raise ConfigError(f"compressed-tensors group {name!r}: activations of type "
                              f"{acts.get('type')!r} with {acts.get('num_bits')!r} bits are "
                              "not supported (FP8 or none)")
    if len(blocks) > 1:
        raise ConfigError(f"compressed-tensors groups with different block structures "
                          f"{sorted(blocks)} are not supported")
    return Fp8Layout("compressed-tensors", "weight_scale", blocks.pop() if blocks else None)


def dequantize(weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None) -> torch.Tensor:
    """fp32 ``weight * scale`` for the [N, K] weight, by the scale's shape: one number (per
    tensor), N numbers ([N] or [N, 1]: per output channel), or with ``block`` one per
    ``block`` tile (the last row and column of tiles may be partial). A checkpoint whose
    groups mix strategies has block scales beside per-channel and per-tensor ones."""
    n, k = weight.shape
    scale = scale.float()
    if scale.numel() == 1:
        return weight.float() * scale.reshape(())
    if tuple(scale.shape) in ((n,), (n, 1)):
        return weight.float() * scale.reshape(n, 1)
    if block is None:
        raise ConfigError(f"a weight of shape {(n, k)} takes one scale or {n} (per output "
                          f"channel), the checkpoint has {tuple(scale.shape)}")
    rows, cols = -(-n // block[0]), -(-k // block[1])
    if tuple(scale.shape) != (rows, cols):
        raise ConfigError(f"a weight of shape {(n, k)} in {block} blocks needs "
                          f"{(rows, cols)} scales, the checkpoint has {tuple(scale.shape)}")
    if n % block[0] == 0 and k % block[1] == 0:  # whole tiles: no weight-sized scales
        tiles = weight.float().view(rows, block[0], cols, block[1])
        return (tiles * scale.view(rows, 1, cols, 1)).view(n, k)
    scales = scale.repeat_interleave(block[0], 0)[:n]
    return weight.float() * scales.repeat_interleave(block[1], 1)[:, :k]


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], layout: Fp8Layout,
                device: torch.device | str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each FP8 ``X.weight`` and its scale replaced by the dequantized
    fp32 ``X.weight``, static activation scales dropped; the other tensors pass through.
    A weight without its scale, or a scale without its weight, is an error. ``device``:
    where the pairs are dequantized (the model's GPU: the copy there is of one byte a
    value, not four, and the products are the GPU's work, not the CPU's)."""

    def pair(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize(weight.to(device), scale.to(device), layout.block)

    suffix = "." + layout.scale_name
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    count = dropped = 0
    for name, tensor in weights:
        if name.endswith(suffix):
            target = name[: -len(suffix)] + ".weight"
            if target in weights_waiting:
                count += 1
                yield target, pair(weights_waiting.pop(target), tensor)
            else:
                scales_waiting[target] = tensor
        elif name.endswith("." + INPUT_SCALE):
            dropped += 1
        elif tensor.dtype == torch.float8_e4m3fn:
            if name in scales_waiting:
                count += 1
                yield name, pair(tensor, scales_waiting.pop(name))
            else:
                weights_waiting[name] = tensor
        else:
            yield name, tensor
    if weights_waiting or scales_waiting:
        lone = sorted(weights_waiting) + sorted(
            n.removesuffix(".weight") + suffix for n in scales_waiting)
        raise ConfigError(f"{layout.method} checkpoint: {len(lone)} tensors without their "
                          f"pair (weight and {layout.scale_name}): {', '.join(lone[:5])}")
    logger.info("%s FP8 checkpoint: %d weights dequantized at load%s", layout.method, count,
                f"; {dropped} static activation scales unused" if dropped else "")
