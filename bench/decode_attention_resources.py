"""Decode attention's kernel variants compiled for a GPU architecture without that GPU:
registers a thread, shared memory, programs an SM and SASS instructions, with the K/V tiles
by pointer and by TMA, with and without the fused attention input.

    python bench/decode_attention_resources.py [--arch 90] [--block-size 64]
        [--cache fp8 bf16] [--tile 64x4x3 ...]
        [--json bench/results/decode_attention_resources.json]

A latency-bound decode grid runs faster the more of its programs an SM holds (the decode
attention section of bench/RESULTS.md), and what an SM holds follows from the registers and
shared memory the compiler gave the kernel. Each variant is the launch ``paged_decode_attention``
makes for Qwen3-8B's heads (32 query, 8 kv, 128 dims) over a cache of ``--block-size``
pages, captured on the CPU and compiled through ``triton.compile`` for ``sm_<arch>``
(specialized as the GPU launch would be: 16-divisible values, 16-byte aligned tensors, PDL
on). Run it under the Triton the device machine has (``PYTHONPATH`` to a ``pip install
--target`` of that version): another version allocates registers differently. It must run
without ``TRITON_INTERPRET``. The registers of the pointer variants matched those read on an
H100 (bench/RESULTS.md), which is what makes the TMA ones worth reading before a GPU run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import triton
from atom_kernels_triton import decode_attention
from atom_kernels_triton.decode_attention import NewTokenInput, paged_decode_attention
from atom_kernels_triton.occupancy import programs_per_sm
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, write_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, SEQS, CONTEXT = 32, 8, 128, 4, 600
REGS_PER_SM, SMEM_PER_SM = 65536, 228 * 1024  # sm_90
TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
         torch.float8_e4m3fn: "fp8e4nv", torch.int32: "i32", torch.int64: "i64"}
TILES = {"fp8": [(64, 4, 3), (32, 4, 3)], "bf16": [(64, 4, 2), (32, 4, 2)]}


def captured_launch(kv_dtype: torch.dtype, tile: tuple, tma: bool, fused: bool,
                    page: int) -> tuple[tuple, dict]:
    """The arguments and options of the one launch the op makes for this variant."""
    calls = []

    class Capture:
        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kw: calls.append((args, kw))

    blocks = SEQS * -(-CONTEXT // page)
    cache = torch.zeros(2, blocks, page, KV_HEADS, HEAD_DIM).to(kv_dtype)
    tables = torch.arange(blocks, dtype=torch.int32).view(SEQS, -1)
    seq_lens = torch.full((SEQS,), CONTEXT, dtype=torch.int32)
    qsl = torch.arange(SEQS + 1, dtype=torch.int32)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.zeros(SEQS, width, dtype=torch.bfloat16)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    new = None
    if fused:
        ones = torch.ones(HEAD_DIM, dtype=torch.bfloat16)
        new = NewTokenInput(k, v, ones, ones, 1e-6, torch.zeros(SEQS, dtype=torch.long),
                            torch.zeros(CONTEXT, HEAD_DIM), torch.zeros(SEQS, dtype=torch.long),
                            True)
    out = torch.empty(SEQS, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    real = decode_attention._decode_kernel
    decode_attention._decode_kernel = Capture()
    try:
        paged_decode_attention(q.view(SEQS, HEADS, HEAD_DIM), cache, tables, seq_lens, qsl, out,
                               HEAD_DIM**-0.5, 1, tile=tile, tma=tma, new_tokens=new)
    finally:
        decode_attention._decode_kernel = real
    args, kw = calls[-1]
    kw = {**kw, "PDL": True, "PROXY_FENCE": bool(kw["TMA"] and fused)}  # as on the GPU
    kw.pop("launch_pdl", None)
    return args, kw


def source(kernel: JITFunction, args: tuple, kw: dict) -> ASTSource:
    """The kernel specialized as a launch with these arguments specializes it."""
    signature, constexprs, attrs = {}, {}, {}
    values = list(args) + [kw[name] for name in kernel.arg_names[len(args):]]
    for i, (name, value) in enumerate(zip(kernel.arg_names, values)):
        if i in kernel.constexprs or isinstance(value, bool) or (
                isinstance(value, int) and value == 1):
            signature[name] = "constexpr"  # Triton folds a 1 into the code
            constexprs[(i,)] = value
            continue
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, TensorDescriptor):
            box = ", ".join(map(str, value.block_shape))
            signature[name] = f"tensordesc<{TYPES[value.base.dtype]}[{box}]>"
        elif isinstance(value, int):
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def resources(compiled: Any, num_warps: int) -> dict:
    """Registers (cuobjdump's resource usage of the cubin), dynamic shared memory, programs
    an SM and SASS instructions."""
    tools = Path(triton.backends.nvidia.__file__).parent / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([tools / "cuobjdump", "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    shared = compiled.metadata.shared
    return {"registers": regs, "shared_bytes": shared,
            "programs_per_sm": programs_per_sm(regs, shared, num_warps, REGS_PER_SM,
                                               SMEM_PER_SM),
            "sass_instructions": len(re.findall(r"/\*[0-9a-f]{4}\*/\s+[^;]*;", sass))}


def parse_tile(spec: str) -> tuple[int, int, int]:
    try:
        block_n, warps, stages = (int(x) for x in spec.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"tile {spec!r}: expected BLOCK_NxWARPSxSTAGES") from None
    return block_n, warps, stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    ap.add_argument("--block-size", type=int, default=64, help="the cache's tokens a page")
    ap.add_argument("--cache", nargs="+", choices=tuple(TILES), default=list(TILES),
                    help="the caches' dtypes")
    ap.add_argument("--tile", nargs="+", type=parse_tile, default=None,
                    help="BLOCK_NxWARPSxSTAGES (default: each cache's two tiles)")
    ap.add_argument("--json", default="bench/results/decode_attention_resources.json")
    args = ap.parse_args()
    if not isinstance(decode_attention._decode_kernel, JITFunction):
        sys.exit("unset TRITON_INTERPRET: the interpreter does not compile")
    kinds = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
    rows = []
    for kv in args.cache:
        for tile in args.tile or TILES[kv]:
            for fused in (True, False):
                for tma in (False, True):
                    launch, kw = captured_launch(kinds[kv], tile, tma, fused, args.block_size)
                    options = {"num_warps": kw.pop("num_warps"),
                               "num_stages": kw.pop("num_stages")}
                    compiled = triton.compile(
                        source(decode_attention._decode_kernel, launch, kw),
                        target=GPUTarget("cuda", args.arch, 32), options=options)
                    rows.append({"cache": kv, "tile": tile, "fused_input": fused, "tma": tma,
                                 **resources(compiled, options["num_warps"])})
                    print(rows[-1], flush=True)
    print(f"\nTriton {triton.__version__}, sm_{args.arch}, pages of {args.block_size}:")
    print(markdown_table(
        ["cache", "tile", "fused input", "K/V loads", "registers", "shared KB", "programs/SM",
         "SASS"],
        [[r["cache"], "x".join(map(str, r["tile"])), "yes" if r["fused_input"] else "no",
          "TMA" if r["tma"] else "pointer", r["registers"], f"{r['shared_bytes'] / 1024:.1f}",
          r["programs_per_sm"], r["sass_instructions"]] for r in rows]))
    write_json(args.json, {"triton": triton.__version__, "arch": args.arch,
                           "block_size": args.block_size, "variants": rows})


if __name__ == "__main__":
    main()
