"""Which experts a DeepSeek MoE layer reads under vLLM's dummy weights (CPU, seconds).

    python bench/vllm_dummy_routing.py [--model deepseek-v2-lite] [--tokens 32] [--trials 20]
        [--json bench/results/vllm_dummy_routing.json]

vLLM's dummy loader draws every parameter uniform in [-1e-3, 1e-3]. A MoE layer's input is
RMSNorm(residual) times a norm weight of that size, so the router's logits are dot products
of two such vectors: ~1e-5. vLLM's DeepSeek-V2/V3 gate (``GateLinear`` with no
``moe_router_dtype`` in the config) returns them in bf16 and ``grouped_topk`` takes
``torch.softmax`` of that bf16 tensor, so the scores come back in bf16, where 1/E +- 1e-5
rounds to 1/E: every score of every token ties, and top-k hands every token the same
experts. A batch-32 decode step then reads k routed experts a layer, as batch 1 does, not
the ~E a step whose tokens route apart reads. ATOM's router computes its logits and scores
in fp32 (``TopKRouter``), where the same logits stay apart.

The script rebuilds that arithmetic for one MoE layer of a shipped config: the residual of
each token is its embedding row (the layers before add products of 1e-3-sized weights, far
smaller), then the norm, the gate, and the two scorings. It prints how many of the E scores
of a token tie with its best and how many distinct expert sets a batch of tokens chose,
under vLLM's bf16 scores and under fp32 ones. ``bench/decode_latency.py --routing tied``
runs the workload the first gives (every router score tied) on the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_models import load_config  # noqa: E402


def vllm_dummy(*shape: int) -> torch.Tensor:
    """One parameter as vLLM's dummy loader draws it: a generator seeded 1234 for it alone."""
    gen = torch.Generator().manual_seed(1234)
    return torch.empty(*shape, dtype=torch.bfloat16).uniform_(-1e-3, 1e-3, generator=gen)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16 in and out, fp32 inside (vLLM's and transformers' RMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf.to(torch.bfloat16) * weight).to(torch.bfloat16)


def route(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts of each token, sorted; how many scores tie with the token's best)."""
    ids = torch.topk(scores.float(), top_k, dim=-1).indices.sort(dim=-1).values
    ties = (scores == scores.max(dim=-1, keepdim=True).values).sum(dim=-1)
    return ids, ties


def run(model: str, tokens: int, trials: int, seed: int) -> dict:
    cfg = load_config(model)
    hidden, experts, top_k = cfg["hidden_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    embed = vllm_dummy(cfg["vocab_size"], hidden)
    norm_w = vllm_dummy(hidden)
    gate_w = vllm_dummy(experts, hidden)
    torch.manual_seed(seed)
    rows = {"vllm_bf16": [], "fp32": []}
    logit_abs = []
    for _ in range(trials):
        ids = torch.randint(0, cfg["vocab_size"], (tokens,))
        x = rms_norm(embed[ids], norm_w, cfg["rms_norm_eps"])
        logits_bf16 = torch.nn.functional.linear(x, gate_w)  # vLLM: bf16 GEMM, bf16 out
        logit_abs.append(logits_bf16.float().abs().max().item())
        for name, scores in (
            ("vllm_bf16", torch.softmax(logits_bf16, dim=-1)),  # bf16 in, bf16 out
            ("fp32", torch.softmax(torch.nn.functional.linear(x.float(), gate_w.float()), dim=-1)),
        ):
            chosen, ties = route(scores, top_k)
            rows[name].append({
                "distinct_sets": len({tuple(r.tolist()) for r in chosen}),
                "experts_touched": int(chosen.unique().numel()),
                "min_ties_with_best": int(ties.min()),
            })
    out = {"model": model, "tokens": tokens, "trials": trials, "experts": experts, "top_k": top_k,
           "max_abs_logit": max(logit_abs)}
    for name, rs in rows.items():
        out[name] = {
            "distinct_sets_max": max(r["distinct_sets"] for r in rs),
            "experts_touched_mean": sum(r["experts_touched"] for r in rs) / len(rs),
            "min_ties_with_best": min(r["min_ties_with_best"] for r in rs),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v2-lite")
    p.add_argument("--tokens", type=int, default=32, help="tokens of one decode batch")
    p.add_argument("--trials", type=int, default=20, help="batches of random tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    res = run(args.model, args.tokens, args.trials, args.seed)
    print(f"{res['model']}: {res['experts']} experts, top-{res['top_k']}; {res['tokens']} tokens a batch, "
          f"{res['trials']} batches; router logits at most {res['max_abs_logit']:.2e} in magnitude")
    print("| scores | distinct expert sets in a batch (max) | experts touched a batch (mean) | "
          "scores tied with a token's best (min) |")
    print("|---|---|---|---|")
    for name, label in (("vllm_bf16", "bf16 softmax of bf16 logits (vLLM grouped_topk)"), ("fp32", "fp32 (ATOM)")):
        r = res[name]
        print(f"| {label} | {r['distinct_sets_max']} | {r['experts_touched_mean']:.1f} | {r['min_ties_with_best']} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
