"""Online FP8 quantization (``--quantization fp8``): the loaded model's weights quantized in
memory, the checkpoint on disk unchanged.

Each layer kind is chosen on its own (``--fp8-layers``), as the blog's recipe serves
attention projections, experts and the output layer at different precisions:

- ``attention``: the linears under a ``self_attn`` module (qkv, o_proj, MLA's q/kv
  down-projections);
- ``mlp``: the dense MLPs' linears (gate_up, down);
- ``experts``: every ``FusedMoE``'s stacked expert weights (shared experts included);
- ``lm_head``: the output layer (a tied head gets a weight of its own).

A linear whose model reads its weight directly (``quantizable`` False) stays as it is, and
so do norms, embeddings and the MoE routers.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from atom_core.errors import ConfigError
from atom_core.layers.embedding import ParallelLMHead
from atom_core.layers.linear import Fp8Quantizable
from atom_core.layers.moe import FusedMoE
from atom_core.quant.fp8 import KIND_W8A8_MIN_ROWS, check_options

logger = logging.getLogger(__name__)


def layer_kind(name: str, module: nn.Module) -> str | None:
    """The kind (``quant.fp8.LAYER_KINDS``) of the module at ``name``; None: no kind."""
    if isinstance(module, FusedMoE):
        return "experts"
    if isinstance(module, ParallelLMHead):
        return "lm_head"
    if not isinstance(module, Fp8Quantizable):
        return None
    parts = name.split(".")
    if "self_attn" in parts:
        return "attention"
    if "mlp" in parts:
        return "mlp"
    return None


def computes_fp8(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor cores the kernels use (CUDA, compute capability
    8.9 or later): where an FP8 checkpoint is served in FP8 unless told otherwise. The CPU
    runs FP8 as reference ops, far slower than its dequantized weights."""
    if device.type != "cuda" or getattr(torch.version, "hip", None):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def require_fp8_device(device: torch.device, what: str) -> None:
    """A ConfigError naming ``what`` where ``device`` has no FP8 arithmetic (CUDA before
    compute capability 8.9); the CPU runs the reference ops."""
    if device.type != "cuda" or getattr(torch.version, "hip", None):
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"{what} needs FP8 support (compute capability 8.9 or later: Ada, "
                          f"Hopper, Blackwell); {name} has {major}.{minor}")


def quantize_model(model: nn.Module, kinds: tuple[str, ...] | list[str],
                   w8a8_min_rows: int | None = None) -> dict[str, int]:
    """Quantize the weights of the layer ``kinds`` in place; how many modules of each kind
    were quantized. ``w8a8_min_rows``: every kind's crossover to W8A8 (None: each kind's
    default, ``KIND_W8A8_MIN_ROWS``)."""
    try:
        check_options(kinds, w8a8_min_rows)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    counts = dict.fromkeys(kinds, 0)
    for name, module in list(model.named_modules()):
        kind = layer_kind(name, module)
        if kind not in counts or not getattr(module, "quantizable", True):
            continue
        module.quantize_fp8(w8a8_min_rows or KIND_W8A8_MIN_ROWS[kind])
        counts[kind] += 1
    first = next(model.parameters(), None)
    if first is not None and first.device.type == "cuda":
        torch.cuda.empty_cache()  # the model-dtype weights just freed
    logger.info("fp8 weights: %s (activations quantized per token from %s rows)",
                ", ".join(f"{n} {k}" for k, n in counts.items()),
                w8a8_min_rows or ", ".join(f"{k} {KIND_W8A8_MIN_ROWS[k]}" for k in counts))
    return counts
