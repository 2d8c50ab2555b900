"""The torch attention backend: correct on every device, and the CPU serving path.

Decodes (one query token) are batched: one padded gather of their blocks and one SDPA call
for all of them, whatever else the batch holds. Prefill chunks run one SDPA call per
sequence, over the new tokens alone when nothing is cached, else over the cached blocks.
An fp8 cache is always read back, the new tokens too, as the Triton kernels read it:
attention then sees the same rounded K/V however the scheduler chunked a prompt, and a
prefix-cache hit what a miss does (a speculative verify step chunks unlike plain decoding).
Everything is torch SDPA (fp32 accumulation on CPU); grouped-query heads are never copied.
A sliding window narrows the masks; sinks join them as one more key (``_add_sinks``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_core.layers.attention.backend import AttentionBackend
from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.layers.transfer import host_to_device
from atom_core.ops.native.kv_cache import FP8_KV_DTYPE, dequantize, write_kv_cache


class NativeAttentionBackend(AttentionBackend):
    """MHA/GQA over a ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` cache.

    A slot of -1 marks a padding token whose K/V is not stored. The cache may be allocated
    with ``torch.empty``: slots a sequence has not written are never read unmasked, and the
    masked ones are zeroed in the gathered copy, so stale NaN/inf cannot leak through.
    An fp8 cache is read dequantized, in fp32 (``k_scale`` / ``v_scale``).
    """

    accepts_written_cache = True
    fp8_kv_cache = True
    supports_sinks = True
    supports_sliding_window = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        cache_written: bool = False,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if not cache_written:
            self.write_cache(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)

        if meta.is_decode_only:
            out = self._decode(
                q, kv_cache, meta.block_tables, meta.seq_lens, min(meta.seq_lens_cpu),
                meta.max_seq_len,
            )
            return out.reshape(num_tokens, -1)

        starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        out = torch.empty_like(q)
        decodes = [i for i in range(meta.num_seqs) if starts[i + 1] - starts[i] == 1]
        if decodes:
            seqs = host_to_device(decodes, torch.long, q.device)
            rows = host_to_device([starts[i] for i in decodes], torch.long, q.device)
            lens = [seq_lens[i] for i in decodes]
            out[rows] = self._decode(
                q[rows], kv_cache, meta.block_tables[seqs], meta.seq_lens[seqs],
                min(lens), max(lens),
            )
        for i in range(meta.num_seqs):
            start, end = starts[i], starts[i + 1]
            if end - start > 1:
                out[start:end] = self._prefill(
                    q[start:end], k[start:end], v[start:end], kv_cache, meta.block_tables[i],
                    seq_lens[i],
                )
        return out.reshape(num_tokens, -1)

    @staticmethod
    def write_cache(
        k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None:
        """Store the new tokens' K/V at their slots, in place (the cache is never reallocated);
        an fp8 cache gets them divided by the scales."""
        write_kv_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale)

    def _gather(
        self, kv_cache: torch.Tensor, block_table: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``length`` context tokens, [..., length, kv_heads, head_dim]."""
        block_size = kv_cache.shape[2]
        num_blocks = -(-length // block_size)
        # Padding (-1) only occurs past a sequence's blocks; clamped, it is masked off below.
        blocks = block_table[..., :num_blocks].clamp(min=0).long()
        shape = (*blocks.shape[:-1], num_blocks * block_size, *kv_cache.shape[3:])
        # index_select copies whole blocks at memcpy speed (advanced indexing is ~3x slower).
        k = kv_cache[0].index_select(0, blocks.flatten()).view(shape)
        v = kv_cache[1].index_select(0, blocks.flatten()).view(shape)
        # An fp8 cache's copy in fp32, times the scales (masked in place later).
        k, v = dequantize(k, self.k_scale), dequantize(v, self.v_scale)
        return k[..., :length, :, :], v[..., :length, :, :]

    def _decode(
        self,
        q: torch.Tensor,  # [S, H, D], one query per sequence
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [S, max_blocks]
        seq_lens: torch.Tensor,  # [S]
        min_len: int,
        max_len: int,
    ) -> torch.Tensor:
        num_seqs = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        k, v = self._gather(kv_cache, block_tables, max_len)  # [S, L, kvh, D]
        cols, seq_lens = torch.arange(max_len, device=q.device), seq_lens.to(q.device)[:, None]
        mask = cols < seq_lens
        if self.sliding_window is not None:  # the query sits at seq_len - 1
            mask &= cols >= seq_lens - self.sliding_window
        if min_len < max_len:
            # Past a shorter sequence's end lie other data or never-written memory; a NaN
            # there would survive the mask (NaN * 0), so zero it. Only columns >= min_len.
            pad = ~mask[:, min_len:, None, None]
            k[:, min_len:].masked_fill_(pad, 0)
            v[:, min_len:].masked_fill_(pad, 0)
        # A sequence's query heads sharing one kv head become that head's "query rows".
        qg = q.view(num_seqs, self.num_kv_heads, group, self.head_dim)
        k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
        mask = mask[:, None, None]
        if self.sinks is not None:
            k, v, mask = _add_sinks(k, v, mask, self.sinks.view(1, self.num_kv_heads, group, 1))
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
        return out.reshape(num_seqs, self.num_heads, self.head_dim)

    def _prefill(
        self,
        q: torch.Tensor,  # [Lq, H, D]: the last Lq of this sequence's `length` tokens
        k: torch.Tensor,  # [Lq, kvh, D]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,  # [max_blocks]
        length: int,
    ) -> torch.Tensor:
        query_len = q.shape[0]
        if query_len < length or kv_cache.dtype == FP8_KV_DTYPE:  # over the cache
            k, v = self._gather(kv_cache, block_table, length)
        k = k.transpose(0, 1).unsqueeze(0).to(q.dtype)
        v = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
        mask, causal = None, True
        if query_len < length or self.sliding_window is not None or self.sinks is not None:
            # Query row r sits at position length - query_len + r.
            rows = torch.arange(length - query_len, length, device=q.device)[:, None]
            cols = torch.arange(length, device=q.device)
            mask, causal = cols <= rows, False
            if self.sliding_window is not None:
                mask &= cols > rows - self.sliding_window
            if self.sinks is not None:
                k, v, mask = _add_sinks(k, v, mask, self.sinks.view(1, -1, 1, 1))
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, is_causal=causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,  # torch >= 2.5; no K/V repeat
        )
        return out[0].transpose(0, 1)


def _add_sinks(
    k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sinks as one more key: K and V of zeros (its score is 0, its value adds nothing)
    whose column of the float mask is the head's sink logit, so each row's softmax gains
    exp(sink) in its denominator. k, v [B, kvh, L, D]; mask bool, broadcasting to the
    scores [B, heads, Lq, L]; sinks broadcasting to [B, heads, Lq, 1]."""
    zero = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    shape = torch.broadcast_shapes(mask.shape[:-1], sinks.shape[:-1])
    bias = torch.zeros(mask.shape, dtype=k.dtype, device=k.device).masked_fill(~mask, -torch.inf)
    bias = torch.cat((bias.expand(*shape, -1), sinks.to(k.dtype).expand(*shape, 1)), dim=-1)
    return torch.cat((k, zero), dim=-2), torch.cat((v, zero), dim=-2), bias
