"""Prefill attention: the Triton paged kernel against cuDNN's, dense and varlen (GPU).

    python bench/cudnn_attention.py [--prompts 16] [--prompt-len 1024] [--decodes 496]

Qwen3-8B heads (32 query, 8 kv, head dim 128), bf16, causal. Prints microseconds a call
(median of 5 means over 20 calls) and TFLOP/s of causal attention (2 * L^2 * D a head):

1. ``--prompts`` x ``--prompt-len`` fresh prompts: the engine's kernel over the paged cache
   (``paged_prefill_attention``), then torch SDPA on dense [B, H, L, D] tensors under each
   backend (flash, cuDNN, memory-efficient), with GQA's kv heads as they are and repeated.
2. cuDNN's varlen form (``torch.ops.aten._cudnn_attention_forward`` with cumulative sequence
   lengths, what torch's nested-tensor SDPA calls) on the engine's packed rows: a mixed step
   (``--decodes`` decode rows lumped into one leading segment, then ``--prompts - 1``
   prompts) and the prompts alone, with K/V contiguous and as strided views of a qkv
   projection's output. Its prefill rows are compared with the Triton kernel's.

Measured on an H200 (bench/RESULTS.md, eighteenth session): dense cuDNN runs 16 x 1024 in
298 us (462 TFLOP/s) against the Triton kernel's 532 (258) and flash's 519; the varlen form
takes 46-60 ms a call on torch 2.11 (it builds its cuDNN graph on every call), so the engine
keeps the Triton kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from atom_core.ops.triton.prefill_attention import paged_prefill_attention

sys.path.insert(0, str(Path(__file__).parent))
from attention_overlap import HEAD_DIM, HEADS, KV_HEADS, make_step, time_us  # noqa: E402

BLOCK_SIZE = 16


def tflops(batch: int, length: int, us: float) -> float:
    return 2 * length * length * HEAD_DIM * HEADS * batch / us / 1e6


def triton_prefill(step: dict, out: torch.Tensor):
    def call() -> None:
        paged_prefill_attention(step["q"], step["kv_cache"], step["block_tables"], step["seq_lens"],
                                step["query_start_loc"], step["prefills"], step["max_query_len"], out, step["scale"])
    return call


def dense(args: argparse.Namespace) -> None:
    b, n = args.prompts, args.prompt_len
    step = make_step(1, 64, b, n)
    us = time_us(triton_prefill(step, torch.empty_like(step["q"])), 20)
    print(f"{b} x {n} fresh prompts: Triton paged kernel {us:.1f} us ({tflops(b, n, us):.0f} TFLOP/s)")
    q = torch.randn(b, HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    group = HEADS // KV_HEADS
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in (True, False):
            def call(backend=backend, gqa=gqa) -> None:
                with sdpa_kernel(backend):
                    if gqa:
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    else:
                        F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)
            label = f"  SDPA {backend.name.lower()}, kv heads {'as they are' if gqa else 'repeated'}"
            try:
                us = time_us(call, 20)
            except RuntimeError as exc:
                print(f"{label}: refused ({str(exc).splitlines()[0][:100]})")
                continue
            print(f"{label}: {us:.1f} us ({tflops(b, n, us):.0f} TFLOP/s)")


def varlen(decodes: int, prompts: int, length: int) -> None:
    step = make_step(decodes, 1100, prompts, length)
    q, total = step["q"], step["q"].shape[0]
    out = torch.zeros_like(q)
    tri = triton_prefill(step, out)
    tri()
    # The new tokens' K/V gathered from the cache into packed rows of a qkv-shaped buffer.
    kc, vc = step["kv_cache"][0], step["kv_cache"][1]
    qkv = torch.zeros(total, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=q.dtype)
    kv_cols = KV_HEADS * HEAD_DIM
    k = qkv[:, HEADS * HEAD_DIM : HEADS * HEAD_DIM + kv_cols].view(total, KV_HEADS, HEAD_DIM)
    v = qkv[:, HEADS * HEAD_DIM + kv_cols :].view(total, KV_HEADS, HEAD_DIM)
    tables, starts = step["block_tables"].cpu(), step["query_start_loc"].cpu().tolist()
    for i in step["prefills"].cpu().tolist():
        a, b = starts[i], starts[i + 1]
        blocks = tables[i][tables[i] >= 0][: -(-(b - a) // BLOCK_SIZE)].cuda().long()
        k[a:b] = kc[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[: b - a]
        v[a:b] = vc[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[: b - a]
    # Decode rows (one a sequence) lumped into one leading segment: its output is discarded.
    segments = ([0, decodes] if decodes > 1 else starts[:decodes + 1]) + starts[decodes + 1 :]
    cu = torch.tensor(segments, dtype=torch.int32, device="cuda")
    longest = max(b - a for a, b in zip(segments, segments[1:]))
    rows = slice(starts[decodes], total)
    print(f"{decodes} decodes + {prompts} x {length} prompts ({total} rows, {len(segments) - 1} segments): "
          f"Triton paged kernel {time_us(tri, 20):.1f} us")
    for label, kk, vv in (("contiguous K/V", k.contiguous(), v.contiguous()), ("K/V as qkv views", k, v)):
        def call(kk=kk, vv=vv) -> torch.Tensor:
            return torch.ops.aten._cudnn_attention_forward(
                q, kk, vv, None, cu, cu, longest, longest, False, 0.0, True, False, scale=step["scale"])[0]
        try:
            got = call()
            diff = (got[rows].float() - out[rows].float()).abs().max().item()
            print(f"  cuDNN varlen, {label}: {time_us(call, 20):.1f} us, prefill rows max |diff| vs Triton {diff:.2e}")
        except RuntimeError as exc:
            print(f"  cuDNN varlen, {label}: failed ({str(exc).splitlines()[0][:100]})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decodes", type=int, default=496)
    args = p.parse_args()
    if args.prompts < 2 or args.prompt_len < 2 or args.decodes < 1:
        p.error("--prompts and --prompt-len want at least 2, --decodes at least 1")
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    dense(args)
    varlen(args.decodes, args.prompts - 1, args.prompt_len)
    varlen(1, args.prompts, args.prompt_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
