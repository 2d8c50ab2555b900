"""Per-row fp8 quantization of activations (GPU): the W8A8 GEMMs' input kernels against
torch's reference ops and the copy bandwidth.

    python bench/fp8_quant.py [--rows 64 512 4096 16384] [--json bench/results/fp8_quant.json]

Three kernels, each at every row count, in Qwen3-8B's widths: ``quantize_rows`` of 4096
values a row (the o_proj input), ``quantize_rows(gated=True)`` of a 2 x 12288 gate | up
row (the down projection's input, silu(gate) * up formed as it loads), and
``rms_norm_quant_fp8`` of 4096 values with a residual (the qkv and gate_up inputs). Each
is timed as a CUDA graph of back-to-back calls on inputs too large to stay in L2; the
peer is the reference arithmetic in torch ops (``atom_core.quant.fp8.quantize_rows`` after
``silu_and_mul`` / ``rms_norm_quant_fp8``'s native op) on the same inputs, and the floor
is each kernel's bytes (read and written once) over the copy bandwidth measured in the run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from atom_kernels_triton.fp8_norm_quant import rms_norm_quant_fp8
from atom_kernels_triton.fp8_quant import quantize_rows

from atom_core.ops.native.norm import rms_norm_quant_fp8 as native_rms_norm_quant_fp8
from atom_core.quant import fp8

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, graph_us, markdown_table, write_json  # noqa: E402

HIDDEN, INTERMEDIATE = 4096, 12288
# Input copies per graph, up to 16: enough that the larger row counts' inputs exceed the
# H200's 60 MB L2. The smallest stay in L2, as a decode step's do: the kernel before wrote
# them.
MIN_GRAPH_BYTES = 256 << 20


def make(name: str, m: int) -> tuple:
    """(kernel call, reference call, bytes moved) of kernel ``name`` at ``m`` rows, on fresh
    random inputs."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    scale_bytes = 4  # a row's fp32 scale
    if name == "quantize_rows":
        x = torch.randn(m, HIDDEN, **bf16)
        return (lambda: quantize_rows(x), lambda: fp8.quantize_rows(x),
                m * (HIDDEN * 3 + scale_bytes))
    if name == "gated":
        gu = torch.randn(m, 2 * INTERMEDIATE, **bf16)
        gate, up = gu[:, :INTERMEDIATE], gu[:, INTERMEDIATE:]
        return (lambda: quantize_rows(gu, gated=True),
                lambda: fp8.quantize_rows(F.silu(gate) * up),
                m * (INTERMEDIATE * 5 + scale_bytes))
    x, r = torch.randn(m, HIDDEN, **bf16), torch.randn(m, HIDDEN, **bf16)
    w = torch.rand(HIDDEN, **bf16)
    # x and the residual read, their sum written, the e4m3 row written.
    return (lambda: rms_norm_quant_fp8(x, r, w, 1e-6),
            lambda: native_rms_norm_quant_fp8(x, r, w, 1e-6),
            m * (HIDDEN * 7 + scale_bytes))


KERNELS = ("quantize_rows", "gated", "rms_norm_quant")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 512, 4096, 16384])
    p.add_argument("--json", default="bench/results/fp8_quant.json")
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bw / 1e12:.2f} TB/s")
    results, rows = [], []
    for m in args.rows:
        for name in KERNELS:
            first = make(name, m)
            copies = min(16, max(1, MIN_GRAPH_BYTES // first[2]))
            calls = [first] + [make(name, m) for _ in range(copies - 1)]
            kernel_us = graph_us([c[0] for c in calls])
            torch_us = graph_us([c[1] for c in calls])
            floor_us = first[2] / bw * 1e6
            tb_s = first[2] / kernel_us / 1e6
            results.append({"kernel": name, "rows": m, "kernel_us": kernel_us,
                            "torch_us": torch_us, "floor_us": floor_us, "kernel_tb_s": tb_s})
            rows.append((name, m, f"{kernel_us:.1f}", f"{torch_us:.1f}", f"{floor_us:.1f}",
                         f"{tb_s:.2f}", f"{floor_us / kernel_us:.2f}"))
            del first, calls
            torch.cuda.empty_cache()
    print(markdown_table(("kernel", "rows", "Triton us", "torch ops us", "floor us",
                          "Triton TB/s", "floor / Triton"), rows))
    write_json(args.json, {"copy_bandwidth": bw, "results": results})


if __name__ == "__main__":
    main()
