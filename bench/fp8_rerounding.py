"""What serving an FP8 checkpoint per row costs in precision: its per-block (or per-tensor)
e4m3 weights are dequantized and quantized again with one scale a row, a second rounding.

    python bench/fp8_rerounding.py [--rows 1024] [--cols 2048] [--block 128]

For each weight kind, the relative Frobenius error against the original weight of: its
per-row quantization (what ``--quantization fp8`` does to a bf16 checkpoint), its
per-block quantization (what the checkpoint on disk holds), and the per-row quantization
of the per-block weights (what ATOM serves from that checkpoint); and the second rounding
alone (re-quantized against the checkpoint's weights). CPU, fp32 arithmetic, seeded.
"""

from __future__ import annotations

import argparse

import torch

from atom_core.loader.fp8_checkpoint import dequantize
from atom_core.quant.fp8 import FP8_DTYPE, FP8_MAX, quantize_rows


def per_block(w: torch.Tensor, block: int) -> torch.Tensor:
    """``w`` quantized to e4m3 with one scale a ``block`` x ``block`` tile, dequantized."""
    n, k = w.shape
    tiles = w.reshape(n // block, block, k // block, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return dequantize(q, scale, (block, block))


def per_row(w: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_rows(w)
    return q.float() * scale[:, None]


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--block", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)  # the Student-t sampler draws from the global generator
    g = torch.Generator().manual_seed(0)
    shape = (args.rows, args.cols)
    kinds = {
        "gaussian": torch.randn(shape, generator=g),
        "student-t (3 dof)": torch.distributions.StudentT(3.0).sample(shape),
        "gaussian, columns scaled log-normally": (
            torch.randn(shape, generator=g) * torch.randn(1, args.cols, generator=g).exp()),
    }
    print(f"{args.rows} x {args.cols} weights, {args.block} x {args.block} blocks; relative "
          "Frobenius error against the original weight")
    print(f"{'weight':40} {'per row':>8} {'per block':>10} {'blocks->rows':>13} "
          f"{'2nd rounding':>13}")
    for name, w in kinds.items():
        blocks = per_block(w, args.block)
        rerounded = per_row(blocks)
        print(f"{name:40} {error(per_row(w), w):8.4f} {error(blocks, w):10.4f} "
              f"{error(rerounded, w):13.4f} {error(rerounded, blocks):13.4f}")


if __name__ == "__main__":
    main()
