"""The contract of a paged attention backend (registered via register_attention_backends)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.ops import resolve_op


@dataclass(frozen=True)
class AttentionInput:
    """What turns the qkv projection's q and k into attention's: an optional per-head
    RMSNorm of q and k (weights ``[head_dim]``, as Qwen3's q_norm / k_norm), then RoPE at
    ``positions`` from ``cos_sin_cache`` (``[max_position, rot_dim]``, cos then sin)."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    is_neox: bool
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6

    @property
    def has_qk_norm(self) -> bool:
        return self.q_weight is not None


class AttentionBackend(ABC):
    """One layer's attention over a paged cache.

    The cache of one layer is a tensor of ``kv_cache_shape(...)``; for MHA/GQA it is
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V). ``forward`` writes
    the new tokens' K/V into the cache at ``meta.slot_mapping`` and returns attention of
    the new queries over each sequence's whole context, causal within the sequence.

    A backend with ``accepts_written_cache`` also takes ``forward(..., cache_written=True)``:
    a fused op (e.g. ``qk_norm_rope_cache_write``) has already stored K/V at the slots,
    so the backend skips its own write. Only backends over the dense cache layout above
    can accept it; the default is False, and then the keyword is never passed.

    ``forward_input`` takes q, k and v as the qkv projection produced them, with the
    ``AttentionInput``'s norms and RoPE still to apply. Every backend has it: the default
    runs the input's ops, then ``forward``; a backend whose kernels can fold the attention
    input into their own launch overrides it.

    ``cuda_graph_safe``: a decode-only batch runs from its tensors alone, so CUDA graphs of
    decode steps replay it. ``step_graph_safe``: so does any batch (prompts, chunks and
    decodes mixed) given metadata whose host-side facts were fixed at capture and whose
    ``decode_seqs``/``prefill_seqs`` say on the device which sequences are which
    (engine/step_graphs.py). ``fp8_kv_cache``: the cache may be float8_e4m3fn
    (``--kv_cache_dtype fp8``): K stored as ``e4m3(k / k_scale)``, saturated, and read back
    as ``stored * k_scale``; V likewise with ``v_scale`` (ops/native/kv_cache.py). The
    layer sets the scales once its weights are loaded (kv_scales.py); a backend reads them
    on every call, and ignores them for a cache of any other dtype.

    ``sinks`` (``supports_sinks``): per-head learned logits [num_heads] that join each
    query row's softmax as one more key with a zero value, so a head may attend to
    nothing (gpt-oss). ``sliding_window`` (``supports_sliding_window``): a query at
    position p sees only keys at positions > p - sliding_window. The layer sets them at
    construction and picks a backend that implements the ones it needs.
    """

    accepts_written_cache: bool = False
    cuda_graph_safe: bool = False
    step_graph_safe: bool = False
    fp8_kv_cache: bool = False  # reads and writes a float8_e4m3fn cache with k/v_scale
    supports_sinks: bool = False
    supports_sliding_window: bool = False
    # Plain numbers, fixed after loading: kernels take them as arguments, and a captured
    # CUDA graph keeps the values it was captured with (graphs are captured after loading).
    k_scale: float = 1.0
    v_scale: float = 1.0
    sinks: torch.Tensor | None = None
    sliding_window: int | None = None

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self._ops: dict[tuple[str, str], Callable[..., Any]] = {}  # see _op

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def preferred_block_size(self, device: torch.device) -> int | None:
        """The cache page size (tokens per block) this backend's kernels run fastest on, on
        ``device``; the engine takes the largest its layers prefer where ``--block-size``
        is not given. None: no preference."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim]
        k: torch.Tensor,  # [T, num_kv_heads * head_dim]
        v: torch.Tensor,  # [T, num_kv_heads * head_dim]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        cache_written: bool = False,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        ...

    def forward_input(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim], before norm and RoPE
        k: torch.Tensor,  # [T, num_kv_heads * head_dim], before norm and RoPE
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        inp: AttentionInput,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        """The input's ops on q's device, then ``forward``. With per-head norms: norms,
        RoPE and the K/V cache write in one op (``qk_norm_rope_cache_write``) where this
        backend accepts a written cache, else the ``rms_norm`` op per head. Then the
        ``rotary_embedding`` op, and ``forward`` writes the cache."""
        d = self.head_dim
        if inp.has_qk_norm:
            if self.accepts_written_cache:
                q, k = self._op("qk_norm_rope_cache_write", q.device)(
                    q, k, v, inp.q_weight, inp.k_weight, inp.eps, inp.positions,
                    inp.cos_sin_cache, kv_cache, meta.slot_mapping, inp.is_neox,
                    self.k_scale, self.v_scale,
                )
                return self.forward(q, k, v, kv_cache, meta, cache_written=True)
            norm = self._op("rms_norm", q.device)
            # Per-head norms: each token's heads as rows of head_dim.
            q = norm(q.reshape(-1, d), inp.q_weight, inp.eps).view(q.shape)
            k = norm(k.reshape(-1, d), inp.k_weight, inp.eps).view(k.shape)
        rotary = self._op("rotary_embedding", q.device)
        q, k = rotary(inp.positions, q, k, d, inp.cos_sin_cache, inp.is_neox)
        return self.forward(q, k, v, kv_cache, meta)

    def _op(self, name: str, device: torch.device) -> Callable[..., Any]:
        """The registry's op for device, resolved once per backend (a layer's eager step
        would otherwise filter and sort the registry three times)."""
        key = (name, device.type)
        if key not in self._ops:
            self._ops[key] = resolve_op(name, device)
        return self._ops[key]
