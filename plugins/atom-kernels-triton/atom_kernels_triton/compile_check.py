"""Compile gpt-oss's expert kernels (``clamped_swiglu_moe``) for a GPU architecture on a
machine without that GPU, at every tile ``bench/mxfp4_moe.py --sweep`` may choose.

    python -m atom_kernels_triton.compile_check [--arch 90] [--dtype bf16] [--block-m 64 ...]
        [--limit N]

A tile that Triton cannot lay out for the target fails in its GPU passes (TTIR to TTGIR),
before any code runs: Triton 3.6 failed 28 of the 32 tiles of 64 or 128 rows for sm_90 when
the decoded weights were the dot's right operand. This check runs those passes through
``triton.compile`` with an explicit ``GPUTarget``, so it needs Triton but no GPU; run it
under the Triton the device machine has (``PYTHONPATH`` to a ``pip install --target`` of
that version) to see what that machine would compile. The arguments are specialized as a
launch at gpt-oss-20b's shapes specializes them (16-divisible values, unit strides). It
must run without ``TRITON_INTERPRET`` (the interpreter replaces the kernels). Exits 1 if
any tile fails.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from atom_kernels_triton import clamped_swiglu_moe as csm

# gpt-oss-20b: 32 experts, top-4, hidden = intermediate = 2880; MXFP4 stacks of w13 [E, 2I,
# H/2] bytes with [E, 2I, H/32] scales and w2 [E, H, I/2] with [E, H, I/32]; 1024 tokens.
HID = INTER = 2880
PAIRS = 1024 * 4
INTS = {
    "_gate_up_kernel": {"x_stride": HID, "w_stride_e": INTER * HID, "w_stride_n": HID // 2,
                        "w_stride_k": 1, "s_stride_e": 2 * INTER * HID // 32,
                        "s_stride_n": HID // 32, "bias_stride_e": 2 * INTER,
                        "num_pairs": PAIRS, "top_k": 4, "hidden": HID, "inter": INTER},
    "_down_kernel": {"w_stride_e": HID * INTER // 2, "w_stride_n": INTER // 2, "w_stride_k": 1,
                     "s_stride_e": HID * INTER // 32, "s_stride_n": INTER // 32,
                     "bias_stride_e": HID, "num_pairs": PAIRS, "hidden": HID, "inter": INTER},
}
FLOATS = ("alpha", "limit")
# Pointer element types; "x" stands for the activations' dtype.
POINTERS = {"w_ptr": "u8", "s_ptr": "u8", "pairs_ptr": "i32", "block_expert_ptr": "i32",
            "weights_ptr": "fp32"}
KERNEL_POINTERS = {"_gate_up_kernel": {"out_ptr": "x"}, "_down_kernel": {"out_ptr": "fp32"}}


def source(kernel: Any, tile: dict[str, int], dtype: str) -> ASTSource:
    """The kernel specialized as a launch with MXFP4 stacks and biases specializes it."""
    name = kernel.fn.__name__
    consts = {"BLOCK_M": tile["BLOCK_M"], "BLOCK_N": tile["BLOCK_N"],
              "BLOCK_K": tile["BLOCK_K"], "PRECISION": "ieee" if dtype == "fp32" else "tf32",
              "MXFP4": True, "HAS_BIAS": True, "PDL": True}
    pointers = {**POINTERS, **KERNEL_POINTERS[name]}
    signature, constexprs, attrs = {}, {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in consts or INTS[name].get(arg) == 1:  # Triton folds a 1 into the code
            signature[arg] = "constexpr"
            constexprs[(i,)] = consts.get(arg, 1)
        elif arg.endswith("_ptr"):
            elem = pointers.get(arg, "x")
            signature[arg] = "*" + (dtype if elem == "x" else elem)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in FLOATS:
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if INTS[name][arg] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def tiles() -> list[dict[str, int]]:
    space = csm.TILE_SPACE
    return [dict(zip(space, values)) for values in itertools.product(*space.values())]


def check(kernel: Any, tile: dict[str, int], dtype: str, arch: int) -> str | None:
    """None if the kernel compiles for ``sm_<arch>`` at ``tile``, else the error's first line."""
    options = {"num_warps": tile["num_warps"], "num_stages": tile["num_stages"]}
    try:
        triton.compile(source(kernel, tile, dtype), target=GPUTarget("cuda", arch, 32),
                       options=options)
    except Exception as e:  # a failed pass raises RuntimeError; report any failure by name
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                    help="the activations' dtype")
    ap.add_argument("--block-m", type=int, nargs="+", help="only tiles of these BLOCK_M")
    ap.add_argument("--limit", type=int, help="check only the first N tiles")
    args = ap.parse_args(argv)
    if not isinstance(csm._gate_up_kernel, JITFunction):
        sys.exit("unset TRITON_INTERPRET: the interpreter does not compile")
    failed = 0
    chosen = [t for t in tiles() if not args.block_m or t["BLOCK_M"] in args.block_m]
    for tile in chosen[:args.limit]:
        for kernel in (csm._gate_up_kernel, csm._down_kernel):
            error = check(kernel, tile, args.dtype, args.arch)
            failed += error is not None
            print(f"{kernel.fn.__name__:16s} {tile}: {error or 'ok'}", flush=True)
    print(f"Triton {triton.__version__}, sm_{args.arch}, {args.dtype}: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
