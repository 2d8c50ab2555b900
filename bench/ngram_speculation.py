"""N-gram speculative decoding on CPU: ATOM with and without ``--method ngram`` beside
Hugging Face transformers with and without prompt lookup, on the embedded SmolLM2 GGUF.

    python bench/ngram_speculation.py [--batch-sizes 1 8] [--output-len 128] [--k 4]
        [--json bench/results/ngram_speculation.json]

The prompts ask the model to repeat or edit a passage, the workload prompt lookup is for
(the output copies spans of the prompt). Decode rate = generated tokens after the first /
time after the first token, greedy fp32, same prompts, process and threads. ATOM's
speculative tokens must equal its plain ones (a difference fails the run). The limit is
plain decode's (weights read once per step over this machine's copy bandwidth) times
the tokens a verifying forward emitted on average.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, write_json  # noqa: E402
from cpu_decode import copy_bandwidth_gbs, time_hf_generate  # noqa: E402

PASSAGE = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor "
           "jugs. How vexingly quick daft zebras jump. The five boxing wizards jump quickly.")
PROMPTS = [
    f"Repeat the following text exactly, twice:\n\n{PASSAGE}",
    f"Rewrite this text with every sentence on its own line:\n\n{PASSAGE}",
    "Repeat exactly: def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    f"Copy this paragraph and then copy it again:\n\n{PASSAGE}",
]


def bench_atom(texts: list[str], bs: int, method: str | None) -> dict:
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams

    kw = {"method": method, "num_speculative_tokens": ARGS.k} if method else {}
    engine = LLMEngine(enable_log_stats=False, max_model_len=2048, dtype="float32",
                       device="cpu", **kw)
    prompts = [engine.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    batch = (prompts * bs)[:bs]
    engine.generate(batch, SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=ARGS.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(batch, params)
    total = time.perf_counter() - t0
    ttft = max(o["ttft"] for o in outs)
    n = sum(o["num_tokens_output"] for o in outs)
    stats = engine.speculator.stats.as_dict() if engine.speculator else None
    weights = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
    return {"decode_tok_s": (n - bs) / (total - ttft), "token_ids": [o["token_ids"] for o in outs],
            "tokens_per_forward": stats["average_tokens_per_forward"] if stats else 1.0,
            "acceptance_rate": stats["acceptance_rate"] if stats else None,
            "weight_bytes": weights}


@functools.cache
def hf_model() -> tuple:
    """transformers' tokenizer and model of the embedded GGUF, loaded once (a GGUF load
    dequantizes every tensor: ~35 s on a 2-core VM)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atom_core.loader import embedded_model_path

    path = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    return tok, model


def bench_hf(texts: list[str], bs: int, lookup: int | None) -> dict:
    tok, model = hf_model()
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                       add_generation_prompt=True) for t in texts]
    enc = tok((prompts * bs)[:bs], return_tensors="pt", padding=True, add_special_tokens=False)
    kw = dict(do_sample=False, pad_token_id=tok.pad_token_id)
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    ttft, total = time_hf_generate(model, enc, ARGS.output_len, **kw)
    n = bs * ARGS.output_len
    return {"decode_tok_s": (n - bs) / (total - ttft)}


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    bw = copy_bandwidth_gbs()
    rows = []
    for bs in ARGS.batch_sizes:
        plain, spec = bench_atom(PROMPTS, bs, None), bench_atom(PROMPTS, bs, "ngram")
        if spec["token_ids"] != plain["token_ids"]:
            raise SystemExit(f"batch {bs}: greedy tokens with ngram drafts differ from without")
        hf_plain = bench_hf(PROMPTS, bs, None)
        # transformers' prompt lookup decoding serves one sequence at a time.
        hf_lookup = bench_hf(PROMPTS, bs, ARGS.k) if bs == 1 else None
        steps_s = bw * 1e9 / plain["weight_bytes"]
        rows.append({
            "batch": bs, "atom_tok_s": plain["decode_tok_s"], "atom_ngram_tok_s":
            spec["decode_tok_s"], "tokens_per_forward": spec["tokens_per_forward"],
            "acceptance_rate": spec["acceptance_rate"], "hf_tok_s": hf_plain["decode_tok_s"],
            "hf_lookup_tok_s": hf_lookup["decode_tok_s"] if hf_lookup else None,
            "limit_tok_s": steps_s * bs, "limit_ngram_tok_s": steps_s * bs
            * spec["tokens_per_forward"],
        })
    print(f"\nSmolLM2-135M-Instruct (GGUF, dequantized), fp32, {os.cpu_count()} CPU threads, "
          f"{ARGS.output_len} output tokens, greedy, k = {ARGS.k}; copy bandwidth "
          f"{bw:.1f} GB/s\n")
    print(markdown_table(
        ["batch", "ATOM tok/s", "ATOM ngram tok/s", "tokens/forward", "acceptance",
         "HF tok/s", "HF prompt lookup tok/s", "limit tok/s (plain / ngram)"],
        [[r["batch"], f"{r['atom_tok_s']:.1f}", f"{r['atom_ngram_tok_s']:.1f}",
          f"{r['tokens_per_forward']:.2f}", f"{r['acceptance_rate']:.0%}",
          f"{r['hf_tok_s']:.1f}",
          f"{r['hf_lookup_tok_s']:.1f}" if r["hf_lookup_tok_s"] else "-",
          f"{r['limit_tok_s']:.0f} / {r['limit_ngram_tok_s']:.0f}"] for r in rows]))
    path = write_json(ARGS.json, {"output_len": ARGS.output_len, "k": ARGS.k,
                                  "copy_bandwidth_gbs": bw, "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--json", default="bench/results/ngram_speculation.json")
    ARGS = parser.parse_args()
    main()
