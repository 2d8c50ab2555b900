"""HBM read bandwidth beside the copy bandwidth the rooflines use.

    python bench/read_bandwidth.py [--gib 4] [--json bench/results/read_bandwidth.json]

The decode rooflines (decode_latency.py) divide the bytes a step reads by the
device-to-device copy bandwidth (bytes read + written per second). A decode step only
reads, and reads can go faster: this prints the copy bandwidth, ``torch.sum``'s read rate,
and the fastest of a grid of Triton streaming reads (programs per SM, elements per
iteration, warps, stages; each program sums one contiguous stretch), then of the same read
through a TMA tensor descriptor (box rows, programs per SM, warps, stages). Medians of 10
timed runs after 3 warm-ups, over a buffer of ``--gib`` GiB (far past the L2).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, event_seconds, markdown_table, write_json  # noqa: E402


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, per_prog, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * per_prog  # past 2^31 elements: int64 offsets
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(start, start + per_prog, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def triton_reads(x: torch.Tensor) -> list[dict]:
    n, sms = x.numel(), torch.cuda.get_device_properties(x.device).multi_processor_count
    rows = []
    grid = itertools.product((2, 4, 8), (4096, 8192, 16384), (4, 8), (2, 3))
    for waves, block, warps, stages in grid:
        programs = sms * waves
        per = triton.cdiv(triton.cdiv(n, programs), block) * block
        out = torch.empty(programs, device=x.device, dtype=torch.float32)
        launch = functools.partial(_read_kernel[(programs,)], x, out, n, per, BLOCK=block,
                                   num_warps=warps, num_stages=stages)
        s = event_seconds(launch)
        rows.append({"bytes_per_s": x.numel() * x.element_size() / s, "programs_per_sm": waves,
                     "BLOCK": block, "num_warps": warps, "num_stages": stages})
    return sorted(rows, key=lambda r: -r["bytes_per_s"])


@triton.jit
def _tma_read_kernel(desc, out_ptr, rows, rows_per_prog, BM: tl.constexpr, BN: tl.constexpr):
    start = tl.program_id(0) * rows_per_prog
    acc = tl.zeros([BM, BN], tl.float32)
    for r in range(start, tl.minimum(start + rows_per_prog, rows), BM):
        acc += desc.load([r, 0]).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def tma_reads(x: torch.Tensor) -> list[dict]:
    """The same streaming read through a TMA tensor descriptor ([BM, 128] boxes of x viewed
    as 128-wide rows): the copy engine's bulk loads instead of each thread's vector loads."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    x2 = x.view(-1, 128)
    rows, sms = x2.shape[0], torch.cuda.get_device_properties(x.device).multi_processor_count
    results = []
    grid = itertools.product((1, 2, 4), (32, 64, 128), (4, 8), (2, 3, 4))
    for waves, bm, warps, stages in grid:
        programs = sms * waves
        per = triton.cdiv(triton.cdiv(rows, programs), bm) * bm
        out = torch.empty(programs, device=x.device, dtype=torch.float32)
        desc = TensorDescriptor.from_tensor(x2, block_shape=[bm, 128])
        launch = functools.partial(_tma_read_kernel[(programs,)], desc, out, rows, per, BM=bm,
                                   BN=128, num_warps=warps, num_stages=stages)
        try:
            s = event_seconds(launch)
        except Exception as exc:  # a tile that does not fit (shared memory) is skipped, and said
            print(f"TMA read BM {bm}, {warps} warps, {stages} stages: {type(exc).__name__}")
            continue
        results.append({"bytes_per_s": x.numel() * x.element_size() / s,
                        "programs_per_sm": waves, "BM": bm, "num_warps": warps,
                        "num_stages": stages})
    return sorted(results, key=lambda r: -r["bytes_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--json", type=Path, default=Path("bench/results/read_bandwidth.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("read_bandwidth.py needs a CUDA GPU")
    copy = copy_bandwidth()
    x = torch.randn(args.gib << 29, device="cuda", dtype=torch.bfloat16)
    nbytes = x.numel() * x.element_size()
    torch_sum = nbytes / event_seconds(lambda: x.sum(dtype=torch.float32))
    reads = triton_reads(x)
    tma = tma_reads(x)
    table = [["copy (read + write)", f"{copy / 1e12:.3f}", "-"],
             ["torch.sum", f"{torch_sum / 1e12:.3f}", "-"]]
    table += [["Triton loads", f"{r['bytes_per_s'] / 1e12:.3f}",
               f"{r['programs_per_sm']} programs/SM, BLOCK {r['BLOCK']}, {r['num_warps']} warps, "
               f"{r['num_stages']} stages"] for r in reads[:3]]
    table += [["TMA loads", f"{r['bytes_per_s'] / 1e12:.3f}",
               f"{r['programs_per_sm']} programs/SM, BM {r['BM']}, {r['num_warps']} warps, "
               f"{r['num_stages']} stages"] for r in tma[:3]]
    print(markdown_table(["read", "TB/s", "config"], table))
    print(f"\nread ceiling / copy bandwidth: {reads[0]['bytes_per_s'] / copy:.3f}")
    write_json(args.json, {"copy_bytes_per_s": copy, "torch_sum_bytes_per_s": torch_sum,
                           "triton_reads": reads, "tma_reads": tma})


if __name__ == "__main__":
    main()
