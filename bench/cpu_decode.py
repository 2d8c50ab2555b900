"""CPU decode throughput: ATOM vs Hugging Face transformers on the embedded SmolLM2 GGUF.

Prints a table (engine, peer and the memory-bandwidth limit side by side) and writes JSON:

    python bench/cpu_decode.py [--batch-sizes 1 8] [--output-len 64] [--compiled]
        [--json bench/results/cpu_decode.json]

Decode rate = generated tokens after the first / time after the first token. Both engines
run greedy at the same dtype (fp32 and bf16 by default), same prompts, process and threads.
The limit is the bytes of weights read per decode step over this machine's copy bandwidth,
measured here.

``--compiled`` also times ATOM with its decoder stack under ``torch.compile`` (inductor,
dynamic shapes) and attention left eager, the split a piecewise ``--level 3`` would make:
a probe of whether the compilation level the serving guide describes would pay on CPU,
where the engine itself refuses ``--level`` above 0. In fp32 its greedy tokens must equal
the eager engine's (a difference fails the run); in bf16 inductor's fused kernels round
differently, so the share of equal tokens is reported instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, write_json  # noqa: E402

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain the difference between a process and a thread.",
    "What are the health benefits of drinking green tea?",
    "Describe how a bill becomes a law in the United States.",
    "Give me three ideas for a weekend project with a Raspberry Pi.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "How does public-key cryptography work?",
    "List some tips for writing clean Python code.",
]


def copy_bandwidth_gbs(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Read + write bytes per second of a large tensor copy (the decode roofline's ceiling)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def bench_atom(prompts: list[str], output_len: int, dtype: str,
               compiled: bool = False) -> tuple[dict, float]:
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.layers.attention.layer import Attention

    engine = LLMEngine(enable_log_stats=False, max_model_len=2048, dtype=dtype, device="cpu")
    eager_attention = Attention.forward
    limit = torch._dynamo.config.recompile_limit
    if compiled:
        # Each layer resumes after its attention's graph break in its own frame, one cache
        # entry per variant seen (first layer's residual None, static then dynamic shapes):
        # past the default limit of 8 the rest would silently run eager.
        torch._dynamo.config.recompile_limit = 64
        # Attention stays eager: a graph break.
        Attention.forward = torch.compiler.disable(eager_attention)
        decoder = engine.runner.model.model
        decoder.forward = torch.compile(decoder.forward, dynamic=True)
    try:
        return _time_atom(engine, prompts, output_len)
    finally:
        torch._dynamo.config.recompile_limit = limit
        Attention.forward = eager_attention


def _time_atom(engine: Any, prompts: list[str], output_len: int) -> tuple[dict, float]:
    from atom_core.sampling_params import SamplingParams

    texts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    # Warm-up (and compile).
    engine.generate(texts[:1], SamplingParams(temperature=0.0, max_tokens=4))
    results = {"warmup_s": time.perf_counter() - t0}
    for bs in ARGS.batch_sizes:
        batch = (texts * bs)[:bs]
        # The batch's own warm-up: with the decoder compiled, its shapes compile here, untimed.
        engine.generate(batch, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        t0 = time.perf_counter()
        outs = engine.generate(batch, params)
        total = time.perf_counter() - t0
        ttft = max(o["ttft"] for o in outs)
        n = sum(o["num_tokens_output"] for o in outs)
        results[bs] = {"decode_tok_s": (n - bs) / (total - ttft), "e2e_tok_s": n / total,
                       "ttft_s": ttft, "token_ids": [o["token_ids"] for o in outs]}
    weight_bytes = sum(p.numel() * p.element_size()
                       for p in engine.loaded.model.parameters())
    return results, weight_bytes


def time_hf_generate(model: Any, enc: Any, output_len: int, **kw: Any) -> tuple[float, float]:
    """(first token s, whole generation s) of a transformers ``generate``, after a warm-up."""
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        t0 = time.perf_counter()
        model.generate(**enc, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(**enc, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
        return ttft, time.perf_counter() - t0


def bench_hf(prompts: list[str], output_len: int, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atom_core.loader import embedded_model_path

    path = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=getattr(torch, dtype))
    model.eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True)
             for p in prompts]
    results = {}
    for bs in ARGS.batch_sizes:
        enc = tok((texts * bs)[:bs], return_tensors="pt", padding=True,
                  add_special_tokens=False)
        kw = dict(do_sample=False, pad_token_id=tok.pad_token_id)
        ttft, total = time_hf_generate(model, enc, output_len, **kw)
        n = bs * output_len
        results[bs] = {"decode_tok_s": (n - bs) / (total - ttft), "e2e_tok_s": n / total,
                       "ttft_s": ttft}
    return results


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    bw = copy_bandwidth_gbs()
    rows = []
    same = True
    for dtype in ARGS.dtypes:
        atom, weight_bytes = bench_atom(PROMPTS, ARGS.output_len, dtype)
        comp = (bench_atom(PROMPTS, ARGS.output_len, dtype, compiled=True)[0]
                if ARGS.compiled else None)
        hf = bench_hf(PROMPTS, ARGS.output_len, dtype)
        limit = bw * 1e9 / weight_bytes  # decode steps/s if a step only streams the weights once
        for bs in ARGS.batch_sizes:
            a, h = atom[bs], hf[bs]
            row = {
                "dtype": dtype, "batch": bs, "weight_mb": weight_bytes / 1e6,
                "atom_decode_tok_s": a["decode_tok_s"], "hf_decode_tok_s": h["decode_tok_s"],
                "ratio": a["decode_tok_s"] / h["decode_tok_s"], "limit_tok_s": limit * bs,
                "atom_ttft_ms": a["ttft_s"] * 1e3, "hf_ttft_ms": h["ttft_s"] * 1e3,
            }
            if comp is not None:
                pairs = [(x, y) for want, got in zip(a["token_ids"], comp[bs]["token_ids"])
                         for x, y in zip(want, got)]
                row.update(compiled_decode_tok_s=comp[bs]["decode_tok_s"],
                           compiled_warmup_s=comp["warmup_s"], eager_warmup_s=atom["warmup_s"],
                           compiled_equal_token_share=sum(x == y for x, y in pairs) / len(pairs))
                if dtype == "float32":
                    same &= comp[bs]["token_ids"] == a["token_ids"]
            rows.append(row)

    print(f"\nSmolLM2-135M-Instruct (GGUF Q4_1, dequantized), {os.cpu_count()} CPU threads, "
          f"{ARGS.output_len} output tokens, greedy; copy bandwidth {bw:.1f} GB/s\n")
    print(markdown_table(
        ["dtype", "batch", "ATOM tok/s", "HF tok/s", "ATOM/HF", "limit tok/s", "ATOM TTFT ms",
         "HF TTFT ms"],
        [[r["dtype"], r["batch"], f"{r['atom_decode_tok_s']:.1f}", f"{r['hf_decode_tok_s']:.1f}",
          f"{r['ratio']:.2f}x", f"{r['limit_tok_s']:.1f}", f"{r['atom_ttft_ms']:.0f}",
          f"{r['hf_ttft_ms']:.0f}"] for r in rows]))
    if ARGS.compiled:
        print("\nATOM with the decoder under torch.compile (attention eager):\n")
        print(markdown_table(
            ["dtype", "batch", "eager tok/s", "compiled tok/s", "first call s (eager / compiled)",
             "compiled tokens equal to eager"],
            [[r["dtype"], r["batch"], f"{r['atom_decode_tok_s']:.1f}",
              f"{r['compiled_decode_tok_s']:.1f}",
              f"{r['eager_warmup_s']:.1f} / {r['compiled_warmup_s']:.1f}",
              f"{r['compiled_equal_token_share']:.0%}"] for r in rows]))
    path = write_json(ARGS.json, {"output_len": ARGS.output_len, "copy_bandwidth_gbs": bw,
                                  "rows": rows})
    print(f"\nwrote {path}")
    if not same:
        raise SystemExit("in float32 the compiled engine's greedy tokens differ from the "
                         "eager engine's")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--compiled", action="store_true",
                        help="also time ATOM with its decoder under torch.compile (see above)")
    parser.add_argument("--json", default="bench/results/cpu_decode.json")
    ARGS = parser.parse_args()
    main()
