"""What a model class registered through ``register_model_architectures`` provides.

The loader builds it as ``cls(hf_config)`` inside ``torch.device(device)`` and
``build_context(BuildContext(device, dtype))`` with ``dtype`` as torch's default dtype, so
parameters are created in place on the target device and layers resolve their ops and
attention backend for it. The model runner then allocates one K/V cache per entry of
``attention_layers()`` and calls ``forward`` inside ``forward_context(meta)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from atom_core.layers.attention.kv_scales import KVScaleLoader
from atom_core.layers.attention.layer import Attention
from atom_core.layers.linear import default_weight_loader


@runtime_checkable
class CausalLM(Protocol):
    def __init__(self, hf_config: Any) -> None: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] int64, the flat batch -> hidden states [T, hidden]."""
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] (the rows to sample from) -> [N, vocab] logits, fp32 or the model's
        dtype (the sampler widens them where it needs to)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors; returns the names of the parameters filled
        (a tied lm_head counts as filled). Unknown rotary ``inv_freq`` buffers are ignored."""
        ...

    def attention_layers(self) -> list[Attention]:
        """The Attention modules in layer order; the runner gives each its own cache."""
        ...


# (fused param name part, checkpoint name part, shard id) for the usual Llama-style fusions.
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: Iterable[tuple[str, str, str | int]] = STACKED_PARAMS,
    skip: tuple[str, ...] = ("rotary_emb.inv_freq",),
) -> set[str]:
    """Copy HF-named tensors into ``model``'s parameters through their ``weight_loader``s.

    A name containing a checkpoint part of ``stacked_params`` goes into the fused
    parameter as that shard. Names matching ``skip``, and ``lm_head.weight`` when the head
    is tied to the embedding, are dropped; KV-cache scales (``k_scale``, ``v_scale``,
    ``kv_scale``) go to their attention layers (layers/attention/kv_scales.py); any other
    unknown name is an error, so a checkpoint that does not fit the model fails loudly
    rather than loading half-way.
    """
    params = dict(model.named_parameters())
    tied = bool(getattr(getattr(model, "lm_head", None), "tied", False))
    stacked_params = tuple(stacked_params)
    needed: dict[str, set[str | int]] = {}
    for fused, _, shard_id in stacked_params:
        needed.setdefault(fused, set()).add(shard_id)
    loaded: set[str] = set()
    shards: dict[str, set[str | int]] = {}
    kv_scales = KVScaleLoader(model)
    for name, tensor in weights:
        if any(s in name for s in skip) or (tied and name == "lm_head.weight"):
            continue
        if name not in params and kv_scales.load(name, tensor):
            continue
        for fused, part, shard_id in stacked_params:
            if part in name:
                target = name.replace(part, fused)
                param = _param(params, target, name)
                param.weight_loader(param, tensor, shard_id)
                # A fused parameter counts as loaded once every one of its parts is.
                got = shards.setdefault(target, set())
                got.add(shard_id)
                if got == needed[fused]:
                    loaded.add(target)
                break
        else:
            param = _param(params, name, name)
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor)
            else:
                default_weight_loader(param, tensor)
            loaded.add(name)
    if tied:
        loaded.add("lm_head.weight")
    return loaded


def _param(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
    try:
        return params[target]
    except KeyError:
        raise KeyError(f"checkpoint tensor {name!r} matches no parameter of the model") from None
