"""The Triton MLA backend (CUDA/ROCm): absorbed decode through the paged latent kernel.

Graph-safe: a decode-only batch is the latent cache write, two batched GEMMs (W_UK into
the queries, W_UV out of the latent result) and the kernel, all reading tensors only,
with grids from tensor shapes; so a captured CUDA graph replays it for any seq_lens.
Mixed and prefill batches (always eager) go through the native backend's split of the
batch: its decode rows come back here, its prefill chunks use native's expanded SDPA.
An fp8 (float8_e4m3fn) cache is written over the layer's ``kv_scale``, saturated, and read
converted to the query's dtype, the scale folded into the softmax scale and the output.
"""

from __future__ import annotations

import torch

from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.layers.attention.mla_native import NativeMLABackend
from atom_kernels_triton.attention_backend import _num_sms
from atom_kernels_triton.mla_decode import (
    MLADecodeConfig,
    mla_decode_attention,
    mla_num_splits,
    write_latent_cache,
)


class TritonMLABackend(NativeMLABackend):
    """MLA over a ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` cache;
    slot -1 (padding) is not stored and a context length of 0 attends to nothing."""

    cuda_graph_safe = True
    fp8_kv_cache = True  # the latent write scales and saturates; the kernel converts back
    # native's forward (mixed batches) writes through this: one launch, slot -1 skipped.
    write_cache = staticmethod(write_latent_cache)
    _sms: int | None = None  # read on first use: no device query during graph capture
    kernel_config: MLADecodeConfig | None = None  # None: the defaults for the dtype

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
        if not meta.is_decode_only:
            return super().forward(q_nope, q_pe, kv_c, k_pe, kv_b_weight, kv_cache, meta)
        # Row i is sequence i's one query. No host-side fact of the batch is read here.
        write_latent_cache(kv_c, k_pe, kv_cache, meta.slot_mapping, self.kv_scale)
        out = self._decode(q_nope, q_pe, kv_b_weight, kv_cache, meta.block_tables, meta.seq_lens)
        return out.reshape(q_nope.shape[0], -1)

    def _decode(
        self,
        q_nope: torch.Tensor,  # [S, H, nope], one query per sequence
        q_pe: torch.Tensor,  # [S, H, rope]
        kv_b_weight: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [S, max_blocks]
        seq_lens: torch.Tensor,  # [S]
        *_host_bounds: int,  # native's (min_len, max_len) for its padded gather: not needed
    ) -> torch.Tensor:  # [S, H, v]
        num_seqs = q_nope.shape[0]
        if self._sms is None:
            self._sms = _num_sms(q_nope.device)  # read once: no device query during capture
        w_uk, w_uv = self._split_kv_b(kv_b_weight.to(q_nope.dtype))
        # Absorb W_UK per head; [H, S, L] viewed as [S, H, L] (the kernel takes strides).
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        latent = q_latent.new_empty(self.num_heads, num_seqs, self.kv_lora_rank)
        config = self.kernel_config or MLADecodeConfig.for_dtype(kv_cache.dtype)
        mla_decode_attention(
            q_latent, q_pe.to(q_latent.dtype), kv_cache, block_tables, seq_lens, self.scale,
            mla_num_splits(num_seqs, self.num_heads, self._sms, config),
            out=latent.transpose(0, 1), config=config, kv_scale=self.kv_scale,
        )
        # Apply W_UV per head on the [H, S, L] layout the kernel wrote: latent -> value space,
        # written through an [H, S, v] view of [S, H, v] so that o_proj's [S, H * v] input
        # is a view, not a copy (cuBLAS takes the row stride H * v).
        out = q_latent.new_empty(num_seqs, self.num_heads, self.v_head_dim)
        torch.bmm(latent, w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return out
