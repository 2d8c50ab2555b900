"""The torch MLA backend: correct on every device, and the CPU serving path.

Decodes (one query token) are batched and absorbed: W_UK is folded into the queries, one
padded gather of the latents and one SDPA call attend in latent space (the keys are the
cached ``[kv_c | k_pe]`` rows, the values their ``kv_c`` part), and W_UV maps the result
back to per-head values. Prefill chunks are not absorbed: one SDPA call per sequence over
full K/V expanded from the new tokens' latents, or from the cached ones when a prefix is
cached or the cache is fp8 (native.py says why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.layers.attention.mla import MLABackend
from atom_core.layers.transfer import host_to_device
from atom_core.ops.native.kv_cache import FP8_KV_DTYPE, dequantize, store_rows


class NativeMLABackend(MLABackend):
    """MLA over a ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` cache.

    A slot of -1 marks a padding token whose latent is not stored. The cache may be
    allocated with ``torch.empty``: unwritten slots are never read unmasked, and masked
    ones are zeroed in the gathered copy, so stale NaN/inf cannot leak through. An fp8
    cache is read dequantized (``kv_scale``).
    """

    fp8_kv_cache = True

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b_weight: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = q_nope.shape[0]
        self.write_cache(kv_c, k_pe, kv_cache, meta.slot_mapping, self.kv_scale)
        if meta.is_decode_only:
            out = self._decode(
                q_nope, q_pe, kv_b_weight, kv_cache, meta.block_tables, meta.seq_lens,
                min(meta.seq_lens_cpu), meta.max_seq_len,
            )
            return out.reshape(num_tokens, -1)

        starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        out = q_nope.new_empty(num_tokens, self.num_heads, self.v_head_dim)
        decodes = [i for i in range(meta.num_seqs) if starts[i + 1] - starts[i] == 1]
        if decodes:
            seqs = host_to_device(decodes, torch.long, q_nope.device)
            rows = host_to_device([starts[i] for i in decodes], torch.long, q_nope.device)
            lens = [seq_lens[i] for i in decodes]
            out[rows] = self._decode(
                q_nope[rows], q_pe[rows], kv_b_weight, kv_cache, meta.block_tables[seqs],
                meta.seq_lens[seqs], min(lens), max(lens),
            )
        for i in range(meta.num_seqs):
            start, end = starts[i], starts[i + 1]
            if end - start > 1:
                out[start:end] = self._prefill(
                    q_nope[start:end], q_pe[start:end], kv_c[start:end], k_pe[start:end],
                    kv_b_weight, kv_cache, meta.block_tables[i], seq_lens[i],
                )
        return out.reshape(num_tokens, -1)

    @staticmethod
    def write_cache(
        kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        scale: float = 1.0,
    ) -> None:
        """Store the new tokens' ``[kv_c | k_pe]`` at their slots, in place; an fp8 cache
        gets them divided by ``scale``."""
        store_rows(kv_cache.view(-1, kv_cache.shape[-1]), slot_mapping,
                   torch.cat((kv_c, k_pe), dim=-1), scale)

    def _gather(self, kv_cache: torch.Tensor, block_table: torch.Tensor, length: int,
                dtype: torch.dtype) -> torch.Tensor:
        """Latents of the first ``length`` context tokens, [..., length, kv_lora_rank + rope],
        in ``dtype`` (an fp8 cache's dequantized)."""
        block_size = kv_cache.shape[1]
        num_blocks = -(-length // block_size)
        # Padding (-1) only occurs past a sequence's blocks; clamped, it is masked off later.
        blocks = block_table[..., :num_blocks].clamp(min=0).long()
        shape = (*blocks.shape[:-1], num_blocks * block_size, kv_cache.shape[-1])
        latents = kv_cache.index_select(0, blocks.flatten()).view(shape)[..., :length, :]
        return dequantize(latents, self.kv_scale).to(dtype)

    def _split_kv_b(self, kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, L], W_UV [H, v, L]): views of kv_b_proj's rows per head."""
        w = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _decode(
        self,
        q_nope: torch.Tensor,  # [S, H, nope], one query per sequence
        q_pe: torch.Tensor,  # [S, H, rope]
        kv_b_weight: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [S, max_blocks]
        seq_lens: torch.Tensor,  # [S]
        min_len: int,
        max_len: int,
    ) -> torch.Tensor:  # [S, H, v]
        w_uk, w_uv = self._split_kv_b(kv_b_weight.to(q_nope.dtype))
        # Absorb W_UK: q_nope . (W_UK kv_c) == (q_nope W_UK) . kv_c, per head.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [S, H, L]
        query = torch.cat((q_latent, q_pe.to(q_latent.dtype)), dim=-1)
        latents = self._gather(kv_cache, block_tables, max_len, query.dtype)  # [S, Lmax, L+R]
        mask = torch.arange(max_len, device=query.device) < seq_lens.to(query.device)[:, None]
        if min_len < max_len:
            # Past a shorter sequence's end lie other data or never-written memory; a NaN
            # there would survive the mask (NaN * 0), so zero it. Only columns >= min_len.
            latents[:, min_len:].masked_fill_(~mask[:, min_len:, None], 0)
        # Every head attends to the same single latent "kv head": heads are query rows.
        out = F.scaled_dot_product_attention(
            query.unsqueeze(1),  # [S, 1, H, L+R]
            latents.unsqueeze(1),  # [S, 1, Lmax, L+R]
            latents[..., : self.kv_lora_rank].unsqueeze(1),  # values: kv_c, [S, 1, Lmax, L]
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
        )[:, 0]  # [S, H, L]
        # Apply W_UV: per head, latent output -> value space.
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(
        self,
        q_nope: torch.Tensor,  # [Lq, H, nope]: the last Lq of this sequence's `length` tokens
        q_pe: torch.Tensor,  # [Lq, H, rope]
        kv_c: torch.Tensor,  # [Lq, L]
        k_pe: torch.Tensor,  # [Lq, rope]
        kv_b_weight: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,  # [max_blocks]
        length: int,
    ) -> torch.Tensor:  # [Lq, H, v]
        query_len = q_nope.shape[0]
        if query_len == length and kv_cache.dtype != FP8_KV_DTYPE:
            mask, causal = None, True
        else:  # over the cache: query row r sees keys up to length - query_len + r
            latents = self._gather(kv_cache, block_table, length, q_nope.dtype)
            kv_c, k_pe = latents.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            mask = torch.ones(query_len, length, dtype=torch.bool, device=q_nope.device)
            mask = mask.tril(diagonal=length - query_len)
            causal = False
        kv = F.linear(kv_c.to(q_nope.dtype), kv_b_weight.to(q_nope.dtype))
        kv = kv.view(length, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rope = k_pe.to(q_nope.dtype)[:, None, :].expand(
            length, self.num_heads, self.qk_rope_head_dim
        )
        key = torch.cat((k_nope, k_rope), dim=-1)
        query = torch.cat((q_nope, q_pe.to(q_nope.dtype)), dim=-1)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            key.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
        )
        return out[0].transpose(0, 1)
