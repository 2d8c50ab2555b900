"""Which grammar engine should structured outputs use: xgrammar or llguidance?

Both are measured with the embedded model's tokenizer (SmolLM2, 49152 tokens) on one
realistic JSON schema (an order: nested objects, an array of objects, an enum, a nullable
object, an integer range, a pattern), the schema compiled once, then a matcher driven along
a valid instance's tokens:

    python bench/grammar_engines.py [--repeats 5] [--json bench/results/grammar_engines.json]

- tokenizer: building the engine's view of the vocabulary (once per server);
- compile: schema -> what a matcher needs, with every cache cold (once per new schema; a
  request waits for it);
- fill: the next-token bitmasks of one step, at batch 1 (one matcher) and 32, by the
  engine's own batched call (its thread pool, 2 threads) and by a Python loop of single
  fills (the better of the two is what a step would use);
- accept: advancing a matcher by the sampled token.
Needs both packages (``pip install xgrammar llguidance``); the engine installs only one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, write_json  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "unit_price": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["sku", "quantity", "unit_price", "tags"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "shipping": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {"address": {"type": "string"}, "express": {"type": "boolean"}},
                    "required": ["address", "express"],
                    "additionalProperties": False,
                },
            ]
        },
        "notes": {"type": "string", "maxLength": 200},
    },
    "required": ["order_id", "customer", "items", "status", "shipping", "notes"],
    "additionalProperties": False,
}

INSTANCE = {
    "order_id": "ABC-123456",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "vip": True},
    "items": [
        {"sku": "KB-01", "quantity": 2, "unit_price": 49.5, "tags": ["keyboard", "usb"]},
        {"sku": "MS-07", "quantity": 1, "unit_price": 19.99, "tags": []},
    ],
    "status": "shipped",
    "shipping": {"address": "12 Analytical Row, London", "express": False},
    "notes": "Leave at the door, please.",
}
VOCAB = 49152
THREADS = 2  # the VM's cores


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def per_token_us(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {"mean": 1e6 * statistics.fmean(samples), "p50": 1e6 * samples[len(samples) // 2],
            "p99": 1e6 * samples[min(len(samples) - 1, int(len(samples) * 0.99))]}


def bench_xgrammar(tokenizer: Any, eos: int, text_tokens: list[int], repeats: int) -> dict:
    import xgrammar as xgr

    t_tok, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=VOCAB, stop_token_ids=[eos]))
    schema = json.dumps(SCHEMA)
    compiles = []
    for _ in range(repeats):
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        dt, compiled = timed(lambda c=compiler: c.compile_json_schema(
            schema, any_whitespace=False, separators=(", ", ": ")))
        compiles.append(dt)
    out = {"tokenizer_s": t_tok, "compile_ms": 1e3 * statistics.median(compiles)}
    for batch in (1, 32):
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        bitmask = xgr.allocate_token_bitmask(batch, VOCAB)
        batcher = xgr.BatchGrammarMatcher(max_threads=THREADS)
        fills, loops, accepts = [], [], []
        for tok in text_tokens:
            t0 = time.perf_counter()
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)
            t1 = time.perf_counter()
            batcher.batch_fill_next_token_bitmask(matchers, bitmask)
            loops.append(t1 - t0)
            fills.append(time.perf_counter() - t1)
            assert (bitmask[0, tok // 32] >> (tok % 32)) & 1, "the instance left the grammar"
            t0 = time.perf_counter()
            for m in matchers:
                assert m.accept_token(tok)
            accepts.append((time.perf_counter() - t0) / batch)
        assert matchers[0].is_completed()
        out[f"fill_b{batch}_us"] = per_token_us(fills)
        out[f"loop_b{batch}_us"] = per_token_us(loops)
        out[f"accept_b{batch}_us"] = per_token_us(accepts)
    return out


def bench_llguidance(tokenizer: Any, eos: int, text_tokens: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t_tok, lltok = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB,
                                                              eos_token=eos))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ",
                          "key_separator": ": "})
    # llguidance builds its lexer and parser when a matcher is made (no separate compile):
    # a fresh tokenizer each time keeps the token-trie caches cold.
    compiles = []
    for _ in range(repeats):
        fresh = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB, eos_token=eos)
        dt, m = timed(lambda f=fresh: llguidance.LLMatcher(f, grammar))
        assert not m.is_error(), m.get_error()
        compiles.append(dt)
    out = {"tokenizer_s": t_tok, "compile_ms": 1e3 * statistics.median(compiles)}
    executor = llguidance.LLExecutor(num_threads=THREADS)
    for batch in (1, 32):
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
        bitmask = lt.allocate_token_bitmask(batch, VOCAB)
        fills, loops, accepts = [], [], []
        for tok in text_tokens:
            t0 = time.perf_counter()
            for i, m in enumerate(matchers):
                lt.fill_next_token_bitmask(m, bitmask, i)
            t1 = time.perf_counter()
            lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)],
                                           bitmask)
            loops.append(t1 - t0)
            fills.append(time.perf_counter() - t1)
            assert (bitmask[0, tok // 32] >> (tok % 32)) & 1, "the instance left the grammar"
            t0 = time.perf_counter()
            for m in matchers:
                assert m.consume_token(tok), m.get_error()
            accepts.append((time.perf_counter() - t0) / batch)
        assert matchers[0].is_accepting()
        out[f"fill_b{batch}_us"] = per_token_us(fills)
        out[f"loop_b{batch}_us"] = per_token_us(loops)
        out[f"accept_b{batch}_us"] = per_token_us(accepts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="bench/results/grammar_engines.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from atom_core.loader import embedded_model_path
    from atom_core.loader.gguf_loader import GGUFFile

    tokenizer = GGUFFile(embedded_model_path()).load_tokenizer()
    eos = tokenizer.eos_token_id
    text = json.dumps(INSTANCE, separators=(", ", ": "))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    results = {"xgrammar": bench_xgrammar(tokenizer, eos, tokens, args.repeats),
               "llguidance": bench_llguidance(tokenizer, eos, tokens, args.repeats)}
    rows = []
    for name, r in results.items():
        rows.append([name, f"{r['tokenizer_s']:.2f}", f"{r['compile_ms']:.1f}",
                     f"{r['loop_b1_us']['mean']:.0f} / {r['loop_b1_us']['p99']:.0f}",
                     f"{r['fill_b32_us']['mean']:.0f} / {r['fill_b32_us']['p99']:.0f}",
                     f"{r['loop_b32_us']['mean']:.0f} / {r['loop_b32_us']['p99']:.0f}",
                     f"{r['accept_b1_us']['mean']:.1f}"])
    print(f"{len(tokens)} tokens of a valid instance, vocabulary {VOCAB}; us per step")
    print(markdown_table(["engine", "tokenizer s", "compile ms", "fill b1 (mean / p99)",
                          "fill b32 batched", "fill b32 loop", "accept us/row"], rows))
    write_json(args.json, {"tokens": len(tokens), "results": results})


if __name__ == "__main__":
    main()
