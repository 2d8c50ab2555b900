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

Quantizing after loading needs the whole model in its dtype first: twice the memory the
FP8 model takes. Where the loader reads a checkpoint directory it builds the linears and
experts without storage instead (``BuildContext.defer_weights``), and ``allocate_weights``
gives the chosen kinds e4m3 storage whose rows are quantized as the checkpoint is read;
``quantize_model`` then does the rest (the LM head). Both give the same bits.
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
    if device.type != "cuda" or getattr(torch.version, "hip", None) or computes_fp8(device):
        return
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    raise ConfigError(f"{what} needs FP8 support (compute capability 8.9 or later: Ada, "
                      f"Hopper, Blackwell); {name} has {major}.{minor}")


def _quantized_kind(name: str, module: nn.Module, kinds: tuple[str, ...] | list[str]
                    ) -> str | None:
    """The kind of the module at ``name`` where ``kinds`` quantizes it, else None."""
    kind = layer_kind(name, module)
    return kind if kind in kinds and getattr(module, "quantizable", True) else None


def _min_rows(kind: str, w8a8_min_rows: int | None) -> int:
    return w8a8_min_rows or KIND_W8A8_MIN_ROWS[kind]


def allocate_weights(model: nn.Module, device: torch.device, dtype: torch.dtype,
                     kinds: tuple[str, ...] | list[str],
                     w8a8_min_rows: int | None = None) -> None:
    """Give the weights a deferred build left on the meta device their storage: e4m3 rows
    and scales for the modules of the layer ``kinds`` (filled as the checkpoint is read),
    ``dtype`` for the others."""
    _check(kinds, w8a8_min_rows)
    for name, module in model.named_modules():
        allocate = getattr(module, "allocate_weights", None)
        if allocate is None or not any(p.is_meta for p in module.parameters(recurse=False)):
            continue
        kind = _quantized_kind(name, module, kinds)
        allocate(device, dtype, None if kind is None else _min_rows(kind, w8a8_min_rows))
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"weights left without storage: {', '.join(left[:5])}")


def _check(kinds: tuple[str, ...] | list[str], w8a8_min_rows: int | None) -> None:
    try:
        check_options(kinds, w8a8_min_rows)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def quantize_model(model: nn.Module, kinds: tuple[str, ...] | list[str],
                   w8a8_min_rows: int | None = None) -> dict[str, int]:
    """Quantize the weights of the layer ``kinds`` in place; how many modules of each kind
    are quantized, those ``allocate_weights`` quantized as they loaded included.
    ``w8a8_min_rows``: every kind's crossover to W8A8 (None: each kind's default,
    ``KIND_W8A8_MIN_ROWS``)."""
    _check(kinds, w8a8_min_rows)
    counts = dict.fromkeys(kinds, 0)
    for name, module in list(model.named_modules()):
        kind = _quantized_kind(name, module, kinds)
        if kind is None:
            continue
        if module.fp8 is None:
            module.quantize_fp8(_min_rows(kind, w8a8_min_rows))
        counts[kind] += 1
    first = next(model.parameters(), None)
    if first is not None and first.device.type == "cuda":
        torch.cuda.empty_cache()  # the model-dtype weights just freed
    logger.info("fp8 weights: %s (activations quantized per token from %s rows)",
                ", ".join(f"{n} {k}" for k, n in counts.items()),
                w8a8_min_rows or ", ".join(f"{k} {KIND_W8A8_MIN_ROWS[k]}" for k in counts))
    return counts
