"""Fresh-prompt prefill attention: the Triton paged kernel against cuDNN's varlen (THD)
fused attention through cudnn-frontend's torch op (GPU).

    pip install nvidia-cudnn-frontend
    python bench/cudnn_varlen.py

Qwen3-8B heads (32 query, 8 kv, head dim 128), bf16, causal, prompts with no cached
prefix. The Triton kernel reads K/V from the paged cache (block size 16, shuffled blocks:
bench/prefill_attention.py's cases); cuDNN reads the same values as strided rows of a
qkv-shaped buffer, which is where a step's projection leaves them. Per case: milliseconds
(median CUDA-event timing, bench/prefill_attention.py's ``time_ms``), TFLOP/s of causal
work, cuDNN's max |diff| from the Triton output, the same call with 64 sequence slots and
a 16,384-token bound (what a graph cached per bucket would run), the first call (its
graph build) and the host time of one call. Then the call captured in a CUDA graph and
replayed over other splits of the same rows, against SDPA per sequence.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from atom_kernels_triton.prefill_attention import paged_prefill_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_attention import make_case, time_ms  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
CASES = {"16x1024": (16, 1024), "4x4096": (4, 4096), "1x448": (1, 448), "1x16384": (1, 16384)}


def qkv_rows(c: dict, batch: int, q_len: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as [T, heads, D] views of one [T, (H + 2 KV) * D] buffer, K/V read out of
    the case's paged cache."""
    t = batch * q_len
    tables = c["block_tables"].long()

    def unpaged(kv: torch.Tensor) -> torch.Tensor:
        return kv[tables].reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :q_len].reshape(
            t, KV_HEADS, HEAD_DIM)

    buf = torch.empty(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q = buf[:, : HEADS * HEAD_DIM].view(t, HEADS, HEAD_DIM)
    k = buf[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(t, KV_HEADS, HEAD_DIM)
    v = buf[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(t, KV_HEADS, HEAD_DIM)
    q.copy_(c["q"])
    k.copy_(unpaged(c["cache"][0]))
    v.copy_(unpaged(c["cache"][1]))
    return q, k, v


def run(sdpa, case: str) -> None:
    batch, q_len = CASES[case]
    c = make_case("qwen3-8b", case)
    out = torch.empty_like(c["q"])
    args = (c["q"], c["cache"], c["block_tables"], c["seq_lens"], c["query_start_loc"],
            c["seq_idx"], c["max_query_len"], out, c["scale"])
    paged_prefill_attention(*args)
    triton_ms = time_ms(lambda: paged_prefill_attention(*args), 200)
    q, k, v = qkv_rows(c, batch, q_len)
    cu = c["query_start_loc"]
    slots = torch.cat([cu, cu[-1:].expand(64 - batch)]).contiguous()

    def cudnn(cu=cu, bound=q_len):
        return sdpa(q, k, v, scale=c["scale"], is_causal=True, cu_seqlens_q=cu,
                    cu_seqlens_kv=cu, max_seqlen_q=bound, max_seqlen_kv=bound)

    start = time.perf_counter()
    got = cudnn()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - start) * 1e3
    diff = float((got.float() - out.float()).abs().max())
    cudnn_ms = time_ms(cudnn, 200)
    padded_ms = time_ms(lambda: cudnn(slots, 16384), 200)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        cudnn()
    host_us = (time.perf_counter() - start) / 50 * 1e6
    torch.cuda.synchronize()
    flops = c["flops"]
    print(f"{case:>8}: Triton {triton_ms:.3f} ms ({flops / triton_ms / 1e9:.0f} TFLOP/s), cuDNN "
          f"{cudnn_ms:.3f} ms ({flops / cudnn_ms / 1e9:.0f}), max|d| {diff:.2e}; 64 slots x 16384 "
          f"{padded_ms:.3f} ms; first call {first_ms:.0f} ms; host {host_us:.0f} us a call")


def replay_check(sdpa) -> None:
    t = 2048
    q = torch.randn(t, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(t, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    cu = torch.tensor([0, t] + [t] * 7, dtype=torch.int32, device="cuda")

    def call():
        return sdpa(q, k, v, scale=HEAD_DIM**-0.5, is_causal=True, cu_seqlens_q=cu,
                    cu_seqlens_kv=cu, max_seqlen_q=t, max_seqlen_kv=t)

    call()  # builds the cuDNN graph outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = call()
    for lens in ([t], [1000, 1048], [17, 500, 1531], [1, 1, 2046]):
        starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
        cu.copy_(torch.tensor(starts + [t] * (9 - len(starts)), dtype=torch.int32))
        graph.replay()
        err = 0.0
        for a, b in zip(starts, starts[1:]):
            ref = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                is_causal=True, enable_gqa=True).transpose(0, 1)
            err = max(err, float((got[a:b].float() - ref.float()).abs().max()))
        print(f"captured, replayed over lengths {lens}: max|d| from SDPA {err:.2e}")


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    import cudnn
    from cudnn.sdpa.fwd.torch_op import sdpa

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn-frontend "
          f"{cudnn.__version__}, cuDNN {cudnn.backend_version()}")
    for case in CASES:
        run(sdpa, case)
    replay_check(sdpa)
    return 0


if __name__ == "__main__":
    sys.exit(main())
