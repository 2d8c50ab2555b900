"""Paged decode attention (atom_kernels_triton.decode_attention) over its launch space (GPU).

For the models' decode shapes, each KV split count and tile (BLOCK_N, warps, stages) is
timed as a CUDA graph of LAYERS back-to-back calls (median replay), each on its own KV cache
(as a model's layers are, so small caches do not all sit in L2), against the roofline: the
KV bytes read over 4.27 TB/s. Marks what the model's backend runs today: ``num_kv_splits``
and the default tile, over an fp8 cache as ``fit_grid`` sizes them (fewer splits, or the
32-row tile, where the grid would not run in one wave).

    python bench/decode_attention.py [--default-only] [--shapes NAME ...] [--kv-dtype fp8]
        [--splits N ...] [--fused-input] [--block-size 16] [--tma 0|1]
        [--json bench/results/decode_attention.json]

``--default-only`` times just what the op picks today (an A/B of kernel changes).
``--kv-dtype fp8`` times an e4m3 cache (``--kv_cache_dtype fp8``), half the bytes a token;
``--f16 0`` / ``--f16 1`` forces the kernel's F16 off or on (computing on K/V in fp16).
``--splits`` limits the sweep's split counts (large batches run one split).
``--block-size`` sets the cache's page (16 by default; the engine's default on Hopper is 64);
``--tma 0`` / ``--tma 1`` forces the K/V tiles' loads by pointer or by TMA (where the pages
hold whole tiles) instead of the op's rule.
``--fused-input`` times the kernel as Qwen3's decode steps run it: from the qkv projection's
raw rows, with the q/k RMSNorm, RoPE and the new token's cache write in the kernel
(``new_tokens``). Tiles that win without it did not always win in the model (RESULTS.md).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from atom_kernels_triton.decode_attention import (
    NewTokenInput,
    num_kv_splits,
    paged_decode_attention,
)

sys.path.insert(0, str(Path(__file__).parent))
from common import run_shapes, shape_args, sweep  # noqa: E402

COPY_BW = 4.27e12
LAYERS = 8
BLOCK_SIZE = 16
# name: (batch, context, q heads, kv heads); head_dim 128, bf16
SHAPES = {
    "qwen3-0.6b bs1 ctx576": (1, 576, 16, 8),
    "qwen3-8b bs1 ctx576": (1, 576, 32, 8),
    # Long contexts at batch 1: a split rule tuned on the 576-token shapes alone would not
    # see what it costs them.
    "qwen3-8b bs1 ctx8192": (1, 8192, 32, 8),
    "qwen3-8b bs1 ctx32768": (1, 32768, 32, 8),
    "qwen3-8b bs16 ctx640": (16, 640, 32, 8),
    "qwen3-8b bs32 ctx640": (32, 640, 32, 8),
    "qwen3-8b bs32 ctx2048": (32, 2048, 32, 8),
    "qwen3-30b-a3b bs32 ctx640": (32, 640, 32, 4),
    "qwen3-8b bs256 ctx1100": (256, 1100, 32, 8),
    # The serving bench's concurrency 64, and the offline bench's 512 running sequences.
    "qwen3-8b bs64 ctx600": (64, 600, 32, 8),
    "qwen3-8b bs512 ctx1100": (512, 1100, 32, 8),
}
SPLITS = [1, 2, 4, 8, 16, 32]
TILES = [(64, 4, 2), (32, 4, 2), (64, 4, 3), (32, 4, 3), (64, 8, 2), (128, 8, 2), (128, 4, 2),
         (128, 4, 3), (64, 4, 4), (128, 8, 3)]


def make_inputs(batch: int, ctx: int, heads: int, kv_heads: int, kv_dtype: torch.dtype,
                fused: bool = False, page: int = BLOCK_SIZE):
    """Caches (one a layer), block tables, lengths, query rows, q [batch, heads, 128], the
    output, and with ``fused`` the new tokens' input: q a column slice of raw qkv rows, the
    newest token (ctx - 1) of each sequence rewritten by every call."""
    blocks_per_seq = -(-ctx // page)
    num_blocks = batch * blocks_per_seq
    caches = [torch.randn(2, num_blocks, page, kv_heads, 128, device="cuda",
                          dtype=torch.bfloat16).to(kv_dtype) for _ in range(LAYERS)]
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    tables = tables.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    new = None
    if fused:
        qkv = torch.randn(batch, (heads + 2 * kv_heads) * 128, device="cuda",
                          dtype=torch.bfloat16)
        q, k, v = qkv.split([heads * 128, kv_heads * 128, kv_heads * 128], dim=-1)
        q = q.view(batch, heads, 128)
        ones = torch.ones(128, device="cuda", dtype=torch.bfloat16)
        cos_sin = torch.randn(ctx, 128, device="cuda")
        positions = torch.full((batch,), ctx - 1, device="cuda", dtype=torch.long)
        last = ctx - 1
        slots = (tables[:, last // page] * page + last % page).long()
        new = NewTokenInput(k, v, ones, ones, 1e-6, positions, cos_sin, slots, True)
    else:
        q = torch.randn(batch, heads, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty((batch, heads, 128), device="cuda", dtype=torch.bfloat16)
    return caches, tables, seq_lens, qsl, q, out, new


def calls(inputs, splits: int, tile, f16: bool | None = None, tma: bool | None = None) -> list:
    """One call a layer, each on its own cache; without a tile, the backend's grid."""
    caches, tables, seq_lens, qsl, q, out, new = inputs
    return [functools.partial(paged_decode_attention, q, cache, tables, seq_lens, qsl, out,
                              128**-0.5, splits, tile=tile, f16=f16, new_tokens=new,
                              fit_grid=tile is None, tma=tma)
            for cache in caches]


def main() -> None:
    args = shape_args(__doc__, "bench/results/decode_attention.json", list(SHAPES), "tile",
                      kv_dtype=True, splits=SPLITS, fused_input=True, block_size=BLOCK_SIZE,
                      tma=True)
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def measure(name: str) -> dict:
        batch, ctx, heads, kv_heads = SHAPES[name]
        inputs = make_inputs(batch, ctx, heads, kv_heads, kv_dtype, args.fused_input,
                             args.block_size)
        roofline = batch * ctx * kv_heads * 128 * 2 * kv_dtype.itemsize / COPY_BW * 1e6
        chosen = num_kv_splits(batch, kv_heads, sms)
        # None: the grid the backend asks for (what a model runs today).
        space = [(chosen, None)]
        if not args.default_only:
            space += [(s, t) for s in args.splits for t in TILES]
        f16 = None if args.f16 is None else bool(args.f16)
        tma = None if args.tma is None else bool(args.tma)
        out = inputs[5]
        found = sweep(functools.partial(calls, inputs, f16=f16, tma=tma), space, out,
                      lambda p: {"splits": p[0], "tile": p[1]})
        best, default, rows = found["best"], found["default"], found["all"]
        print(f"{name:28s} roofline {roofline:6.2f} us | today (splits <= {chosen}, fitted) "
              f"{default['us']:6.2f} us | best (splits {best['splits']}, "
              f"tile {best['tile'] or 'default'}) {best['us']:6.2f} us | "
              f"max diff {max(r['max_abs_diff'] for r in rows):.2e}", flush=True)
        return {"roofline_us": roofline, **found}

    run_shapes(args.shapes, measure, args.json)


if __name__ == "__main__":
    main()
