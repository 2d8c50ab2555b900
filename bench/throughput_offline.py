"""Offline throughput: LLMEngine.generate on N random prompts vs transformers' static batching.

    python bench/throughput_offline.py [--model qwen3-8b] [--num-prompts 1024] [--input-len 1024]
        [--output-len 128] [--hf-batch-size 64] [--hf-batches 2] [--json ...]

Total tok/s = (prompt + generated tokens) / wall time of the whole generate call (the
figure vLLM's offline throughput benchmark prints). transformers runs fixed batches of
--hf-batch-size prompts (static cache, greedy, every sequence to --output-len); its rate is
measured over --hf-batches batches (it is the same for every batch: same shapes).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_latency import hf_generate  # noqa: E402
from gpu_models import CONFIGS, config_path, hf_model, machine, randomize  # noqa: E402


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def bench_atom(results: dict) -> None:
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams

    cfg = CONFIGS[ARGS.model]
    t0 = time.perf_counter()
    engine = LLMEngine(
        str(config_path(ARGS.model)), load_dummy="empty", dtype="bfloat16", device="cuda",
        enable_log_stats=False, max_model_len=ARGS.input_len + ARGS.output_len + 16,
        max_num_seqs=ARGS.max_num_seqs, max_num_batched_tokens=ARGS.max_num_batched_tokens,
    )
    randomize(engine.runner.model)
    results["atom_startup_s"] = time.perf_counter() - t0
    ps = prompts(ARGS.num_prompts, ARGS.input_len, cfg["vocab_size"])
    engine.generate(ps[:8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=ARGS.output_len, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(ps, params)
    wall = time.perf_counter() - t0
    n_in = sum(o["num_tokens_input"] for o in outs)
    n_out = sum(o["num_tokens_output"] for o in outs)
    results["atom"] = {
        "wall_s": wall, "total_tok_s": (n_in + n_out) / wall, "output_tok_s": n_out / wall,
        "num_prompts": len(ps), "kv_blocks": engine.runner.num_blocks,
        "preemptions": engine.num_preemptions,
    }
    print(f"ATOM: {len(ps)} prompts in {wall:.1f} s: {(n_in + n_out) / wall:,.0f} tok/s total, "
          f"{n_out / wall:,.0f} generated tok/s", flush=True)
    del engine
    gc.collect()
    torch.cuda.empty_cache()


@torch.inference_mode()
def bench_hf(results: dict) -> None:
    cfg = CONFIGS[ARGS.model]
    try:
        model = hf_model(ARGS.model)
    except Exception as exc:
        results["hf_error"] = f"{type(exc).__name__}: {exc}"
        return
    bs = ARGS.hf_batch_size
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static",
              max_new_tokens=ARGS.output_len, min_new_tokens=ARGS.output_len)
    try:
        warm = torch.tensor(prompts(bs, ARGS.input_len, cfg["vocab_size"], 99), device="cuda")
        hf_generate(model, warm, attention_mask=torch.ones_like(warm), **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in range(ARGS.hf_batches):
            ids = torch.tensor(prompts(bs, ARGS.input_len, cfg["vocab_size"], b), device="cuda")
            hf_generate(model, ids, attention_mask=torch.ones_like(ids), **kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        tokens = ARGS.hf_batches * bs * (ARGS.input_len + ARGS.output_len)
        results["hf"] = {"batch_size": bs, "batches": ARGS.hf_batches, "wall_s": wall,
                         "total_tok_s": tokens / wall,
                         "output_tok_s": ARGS.hf_batches * bs * ARGS.output_len / wall}
        print(f"transformers static batching (bs {bs}): {tokens / wall:,.0f} tok/s total", flush=True)
    except Exception as exc:
        results["hf_error"] = f"{type(exc).__name__}: {exc}"
    del model
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    results: dict = {"machine": machine(), "args": vars(ARGS)}
    bench_atom(results)
    Path(ARGS.json).parent.mkdir(parents=True, exist_ok=True)
    Path(ARGS.json).write_text(json.dumps(results, indent=1))
    if ARGS.hf_batches > 0:
        bench_hf(results)
        Path(ARGS.json).write_text(json.dumps(results, indent=1))
    print("\n| engine | prompts | wall s | total tok/s | generated tok/s |")
    print("|---|---|---|---|---|")
    a = results["atom"]
    print(f"| ATOM | {a['num_prompts']} | {a['wall_s']:.1f} | {a['total_tok_s']:,.0f} | {a['output_tok_s']:,.0f} |")
    if "hf" in results:
        h = results["hf"]
        print(f"| transformers (static, bs {h['batch_size']}) | {h['batches'] * h['batch_size']} | "
              f"{h['wall_s']:.1f} | {h['total_tok_s']:,.0f} | {h['output_tok_s']:,.0f} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b", choices=list(CONFIGS))
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--hf-batches", type=int, default=2)
    p.add_argument("--json", default="bench/results/throughput_offline.json")
    ARGS = p.parse_args()
    main()
