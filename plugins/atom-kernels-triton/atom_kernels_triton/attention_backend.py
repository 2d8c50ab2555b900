"""The Triton paged attention backend (CUDA/ROCm): decode and prefill/extend kernels.

Graph-safe: a decode-only batch is computed from tensors alone (seq_lens, block_tables,
query_start_loc, slot_mapping) with a grid that depends only on tensor shapes, so a
captured CUDA graph replays it for any contents of those tensors. Mixed and prefill
batches split decodes from prefills by the host-side query lengths when eager, and by the
metadata's padded ``decode_seqs``/``prefill_seqs`` when captured: both kernels skip the
-1 padding, and the prefill grid spans the step's padded token count.

An fp8 (float8_e4m3fn) cache is written as the native backend writes it (over the layer's
k_scale / v_scale, saturated to e4m3's range) and read as attention over the dequantized
cache (each tile converted to the query's dtype, the scales folded into the softmax scale
and the output).

Attention sinks and sliding windows (gpt-oss) are kernel arguments, the layer's sink
logits tensor and window length, so graphs replay them; both kernels compile them in only
for the layers that have them (constexpr flags), so other layers run the kernels as they
were. The decode kernel's splits divide only the window's keys, and the sinks join the
denominator where the splits merge.
"""

from __future__ import annotations

import torch

from atom_core.layers.attention.backend import AttentionBackend, AttentionInput
from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.layers.transfer import host_to_device
from atom_kernels_triton.decode_attention import (
    PRELOAD_MIN_SPLITS,
    NewTokenInput,
    num_kv_splits,
    paged_decode_attention,
)
from atom_kernels_triton.kv_cache import prefers_tma_pages, write_kv_cache
from atom_kernels_triton.occupancy import device_limits
from atom_kernels_triton.prefill_attention import TMA_BLOCK_N, paged_prefill_attention

_PLAN = "_triton_attention_plan"  # per-batch index tensors, built once for all layers


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return device_limits(device).sms
    return 8  # the interpreter on CPU: any small number exercises the split path


class TritonAttentionBackend(AttentionBackend):
    """MHA/GQA over the common ``[2, num_blocks, block_size, kv_heads, head_dim]`` cache."""

    cuda_graph_safe = True
    step_graph_safe = True
    accepts_written_cache = True
    fp8_kv_cache = True
    supports_sinks = True
    supports_sliding_window = True

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__(num_heads, head_dim, num_kv_heads, scale)
        self._sms: int | None = None

    def preferred_block_size(self, device: torch.device) -> int | None:
        """Pages that hold whole TMA tiles where the prefill kernel loads K/V by TMA
        (prefill_attention.py); decode attention runs as fast over them as over 16-token
        pages (the offline fp8 run: 33.59 against 33.86 ms a decode-only step, H100)."""
        return TMA_BLOCK_N if prefers_tma_pages(device, self.head_dim) else None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        cache_written: bool = False,
    ) -> torch.Tensor:
        if not cache_written:
            write_kv_cache(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        if meta.is_decode_only:
            return self._decode(q, kv_cache, meta, self._splits(meta.seq_lens.shape[0], q.device))
        num_tokens = q.shape[0]
        q3 = q.reshape(num_tokens, self.num_heads, self.head_dim)
        out = torch.empty((num_tokens, self.num_heads, self.head_dim), dtype=q.dtype,
                          device=q.device)
        decodes, prefills = self._plan(meta, q.device)
        if decodes.shape[0]:
            splits = self._splits(decodes.shape[0], q.device)
            paged_decode_attention(
                q3, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
                self.scale, splits, seq_idx=decodes, k_scale=self.k_scale,
                v_scale=self.v_scale, sinks=self.sinks, sliding_window=self.sliding_window,
                fit_grid=True,
            )
        paged_prefill_attention(
            q3, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, prefills,
            meta.max_query_len, out, self.scale, self.k_scale, self.v_scale,
            sinks=self.sinks, sliding_window=self.sliding_window,
        )
        return out.view(num_tokens, -1)

    def forward_input(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        inp: AttentionInput,
    ) -> torch.Tensor:
        """With per-head norms, a decode-only batch over a few KV splits runs one kernel
        (decode_attention.py's ``new_tokens``). Other batches take the base class's path
        (the input ops, then ``forward`` over the written cache). Over many splits (batch
        1) the kernel preloads before its PDL wait, and the fused input's registers made it
        slower there (bench/decode_latency.py on the H200), so those grids keep the
        separate launch."""
        # The fused kernel stores each row's K/V itself: rows of one sequence (drafts run as
        # decode rows) would read each other's before they are stored.
        if inp.has_qk_norm and meta.is_decode_only and meta.new_rows_per_seq == 1 and q.shape[0]:
            splits = self._splits(meta.seq_lens.shape[0], q.device)
            if splits < PRELOAD_MIN_SPLITS:
                new = NewTokenInput(k, v, inp.q_weight, inp.k_weight, inp.eps, inp.positions,
                                    inp.cos_sin_cache, meta.slot_mapping, inp.is_neox)
                return self._decode(q, kv_cache, meta, splits, new)
        return super().forward_input(q, k, v, kv_cache, meta, inp)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                splits: int, new: NewTokenInput | None = None) -> torch.Tensor:
        num_tokens = q.shape[0]
        q3 = q.reshape(num_tokens, self.num_heads, self.head_dim)
        out = torch.empty((num_tokens, self.num_heads, self.head_dim), dtype=q.dtype,
                          device=q.device)
        paged_decode_attention(
            q3, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
            self.scale, splits, new_tokens=new, fresh=meta.new_rows_per_seq,
            k_scale=self.k_scale, v_scale=self.v_scale, sinks=self.sinks,
            sliding_window=self.sliding_window, fit_grid=True,
        )
        return out.view(num_tokens, -1)

    def _splits(self, num_seqs: int, device: torch.device) -> int:
        if self._sms is None:
            self._sms = _num_sms(device)  # read once: no device query during capture
        return num_kv_splits(num_seqs, self.num_kv_heads, self._sms)

    @staticmethod
    def _plan(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(decode sequence indices, prefill sequence indices), made once per batch."""
        if meta.decode_seqs is not None and meta.prefill_seqs is not None:
            return meta.decode_seqs, meta.prefill_seqs
        plan = getattr(meta, _PLAN, None)
        if plan is None:
            starts = meta.query_start_loc_cpu
            lens = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
            dec = [i for i, n in enumerate(lens) if n == 1]
            pre = [i for i, n in enumerate(lens) if n > 1]
            # The prefill indices start 16-byte aligned: Triton compiles a kernel variant per
            # pointer alignment, and the number of decodes before them varies every step.
            gap = -len(dec) % 4
            both = host_to_device(dec + [0] * gap + pre, torch.int32, device)
            plan = (both[: len(dec)], both[len(dec) + gap :])
            setattr(meta, _PLAN, plan)
        return plan
