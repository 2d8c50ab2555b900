"""Paged MLA decode (atom_kernels_triton.mla_decode: the latent kernel and its split merge)
over its launch space (GPU).

For DeepSeek's decode shapes (kv_lora_rank 512, rope 64, bf16), each KV split count and
config (BLOCK_N, warps, stages) is timed as a CUDA graph of LAYERS back-to-back calls
(median replay), each on its own latent cache, against the roofline: the latent bytes
read over 4.27 TB/s. Marks what ``mla_num_splits`` and the default config pick today.

    python bench/mla_decode.py [--default-only] [--shapes NAME ...]
        [--json bench/results/mla_decode.json]
"""

from __future__ import annotations

import functools
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from atom_kernels_triton.mla_decode import MLADecodeConfig, mla_decode_attention, mla_num_splits

sys.path.insert(0, str(Path(__file__).parent))
from common import run_shapes, shape_args, sweep  # noqa: E402

COPY_BW = 4.27e12
LAYERS = 8
BLOCK_SIZE = 16
RANK, ROPE = 512, 64
# name: (batch, context, heads)
SHAPES = {
    "deepseek-v2-lite bs1 ctx576": (1, 576, 16),
    "deepseek-v2-lite bs32 ctx640": (32, 640, 16),
    "deepseek-v3 bs1 ctx576": (1, 576, 128),
    "deepseek-v3 bs32 ctx640": (32, 640, 128),
}
SPLITS = [1, 2, 4, 8, 16, 32]
CONFIGS = [(32, 4, 2), (16, 4, 2), (16, 4, 3), (32, 4, 3), (32, 8, 2), (64, 4, 2)]


def make_inputs(batch: int, ctx: int, heads: int):
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    caches = [torch.randn(num_blocks, BLOCK_SIZE, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
              for _ in range(LAYERS)]
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    tables = tables.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, RANK, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, heads, ROPE, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    return caches, tables, seq_lens, q, q_pe, out


def calls(inputs, splits: int, config: MLADecodeConfig | None) -> list:
    """One call a layer, each on its own cache."""
    caches, tables, seq_lens, q, q_pe, out = inputs
    scale = (128 + ROPE) ** -0.5
    return [functools.partial(mla_decode_attention, q, q_pe, cache, tables, seq_lens, scale,
                              splits, out=out, config=config) for cache in caches]


def main() -> None:
    args = shape_args(__doc__, "bench/results/mla_decode.json", list(SHAPES), "config")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default_config = MLADecodeConfig.for_dtype(torch.bfloat16)

    def measure(name: str) -> dict:
        batch, ctx, heads = SHAPES[name]
        inputs = make_inputs(batch, ctx, heads)
        roofline = batch * ctx * (RANK + ROPE) * 2 / COPY_BW * 1e6
        chosen = mla_num_splits(batch, heads, sms, default_config)
        space: list[tuple] = [(chosen, None)]
        if not args.default_only:
            space += [(s, MLADecodeConfig(block_n=n, num_warps=w, num_stages=st))
                      for s in SPLITS for n, w, st in CONFIGS]
        found = sweep(functools.partial(calls, inputs), space, inputs[-1],
                      lambda p: {"splits": p[0], "config": asdict(p[1]) if p[1] else None})
        best, default, rows = found["best"], found["default"], found["all"]
        c = best["config"]
        cfg = c and (c["block_n"], c["num_warps"], c["num_stages"])
        print(f"{name:30s} roofline {roofline:6.2f} us | today (splits {chosen}) "
              f"{default['us']:6.2f} us | best (splits {best['splits']}, "
              f"config {cfg or 'default'}) {best['us']:6.2f} us | "
              f"max diff {max(r['max_abs_diff'] for r in rows):.2e}", flush=True)
        return {"roofline_us": roofline, **found}

    run_shapes(args.shapes, measure, args.json)


if __name__ == "__main__":
    main()
