"""Serving overhead: the server's TPOT beside the in-process engine's, and the stream's merge
factor.

    python bench/serving_overhead.py [--model DIR] [--output-len 64] [--num-prompts 6]
        [--concurrency 64] [--concurrent-output-len 32] [--json bench/results/serving_overhead.json]

Concurrency 1: ``--num-prompts`` requests one after another, each ``--output-len`` tokens
(greedy, ignore_eos), through the server and through ``LLMEngine.generate`` in this
process, on the same token-id prompts; "server adds X% to TPOT" compares the two means.

Concurrency 64: ``--concurrency`` streams at once, ``--concurrent-output-len`` tokens each,
and the engine running the same prompts as one batch for reference. The client measures
as vLLM's benchmark does: ITL once per received SSE chunk, TPOT per request =
(latency - ttft) / (output_tokens - 1). A stream that merges several tokens into one
chunk shows ITL/TPOT > 1 (the merge factor); tokens per chunk is printed beside it.

The client is aiohttp on the raw SSE lines (no SDK). Server and engine are both loaded
and take turns (an idle server costs no CPU), so a busy neighbour on a shared machine
slows both sides alike instead of whichever ran second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from atom_core.entrypoints.server_process import ServerProcess

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, markdown_table, write_json  # noqa: E402

PROMPT = (
    "Write a detailed explanation of how a hash map works, covering hashing, collisions, "
    "load factor and resizing, with an example in Python."
)


# ----------------------------------------------------------------------------- server


def start_server(model: str | None, max_model_len: int, log: Path) -> ServerProcess:
    extra = ["--max-model-len", str(max_model_len), "--no-enable-log-stats",
             # Connections idle while the in-process engine takes its turn; the default
             # keep-alive would close them under the client (ServerDisconnectedError).
             "--timeout-keep-alive", "3600"]
    return ServerProcess(model, *extra, log=log)


# ----------------------------------------------------------------------------- client


@dataclass
class StreamResult:
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    chunks: int = 0  # SSE chunks that carried a choice
    server_tpot: float = 0.0  # usage.tpot_s: the engine's own clock, inside the server
    server_ttft: float = 0.0  # usage.ttft_s, likewise

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: list[int],
                     output_len: int) -> StreamResult:
    """One streamed completion, timed per SSE chunk the way vLLM's benchmark client does."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    out = StreamResult()
    st = time.perf_counter()
    last = st
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"stream error: {data['error']}")
            if data.get("choices"):
                now = time.perf_counter()
                if out.chunks == 0:
                    out.ttft = now - st
                else:
                    out.itl.append(now - last)
                last = now
                out.chunks += 1
            elif usage := data.get("usage"):
                out.output_tokens = usage["completion_tokens"]
                out.server_tpot = usage.get("tpot_s", 0.0)
                out.server_ttft = usage.get("ttft_s", 0.0)
    out.latency = last - st
    if out.output_tokens != output_len:
        raise RuntimeError(f"a request returned {out.output_tokens} tokens, expected {output_len}")
    return out


async def stream_all(session: aiohttp.ClientSession, url: str, prompts: list[list[int]],
                     output_len: int) -> tuple[list[StreamResult], float]:
    """Every prompt at once (the session's connector allows that many connections)."""
    t0 = time.perf_counter()
    results = await asyncio.gather(*(stream_one(session, url, p, output_len) for p in prompts))
    return list(results), time.perf_counter() - t0


# ----------------------------------------------------------------------------- engine


def load_engine(model: str | None) -> Any:
    from atom_core.engine.llm_engine import LLMEngine

    return LLMEngine(model, enable_log_stats=False, max_model_len=ARGS.max_model_len)


def chat_prompt(engine: Any, text: str) -> list[int]:
    """Token ids both sides receive. Chat-templated where the model has a template: a raw
    prompt makes an instruct model emit end-of-turn specials, which decode to no text and
    so to no SSE chunk, and the stream would look merged when it is not. (Prefix caching
    is off on both sides, so the template's shared head is computed for every prompt.)"""
    from atom_core.errors import InvalidRequestError

    try:
        text = engine.apply_chat_template([{"role": "user", "content": text}])
    except InvalidRequestError:  # no chat template: the raw text will do
        pass
    return engine.tokenize(text)


def engine_generate(engine: Any, prompts: list[list[int]],
                    output_len: int) -> tuple[list[dict[str, Any]], float]:
    from atom_core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return outs, time.perf_counter() - t0


async def measure(engine: Any, url: str, conc1: list[list[int]],
                  batch: list[list[int]]) -> dict[str, Any]:
    """Engine and server take turns on the same prompts (the idle one costs no CPU), so
    drift on a shared machine hits both alike; at concurrency 1 the order alternates."""
    connector = aiohttp.TCPConnector(limit=len(batch))
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # Warm-up at both shapes: first touches of weights, KV cache and batch-sized buffers
        # are slow on a fresh VM, and must not land in either side's numbers.
        for _ in range(2):
            engine_generate(engine, conc1[:1], ARGS.output_len)
            await stream_one(session, url, conc1[0], ARGS.output_len)
        engine_generate(engine, batch, 4)
        await stream_all(session, url, batch, 4)

        eng1: list[dict[str, Any]] = []
        srv1: list[StreamResult] = []
        for i, p in enumerate(conc1):
            if i % 2:
                srv1.append(await stream_one(session, url, p, ARGS.output_len))
            eng1 += engine_generate(engine, [p], ARGS.output_len)[0]
            if not i % 2:
                srv1.append(await stream_one(session, url, p, ARGS.output_len))
        srv64, srv64_s = await stream_all(session, url, batch, ARGS.concurrent_output_len)
        eng64, eng64_s = engine_generate(engine, batch, ARGS.concurrent_output_len)
    return {"eng1": eng1, "srv1": srv1, "srv64": srv64, "srv64_s": srv64_s, "eng64": eng64,
            "eng64_s": eng64_s}


# ----------------------------------------------------------------------------- report


def summarize(results: list[StreamResult], wall_s: float) -> dict[str, Any]:
    itl = [x for r in results for x in r.itl]
    tokens = sum(r.output_tokens for r in results)
    return {
        "requests": len(results),
        "mean_ttft_ms": statistics.mean(r.ttft for r in results) * 1e3,
        "mean_tpot_ms": statistics.mean(r.tpot for r in results if r.output_tokens > 1) * 1e3,
        "mean_itl_ms": statistics.mean(itl) * 1e3 if itl else 0.0,
        "p99_itl_ms": sorted(itl)[int(0.99 * (len(itl) - 1))] * 1e3 if itl else 0.0,
        "server_reported_tpot_ms": statistics.mean(r.server_tpot for r in results) * 1e3,
        "server_reported_ttft_ms": statistics.mean(r.server_ttft for r in results) * 1e3,
        "tokens_per_chunk": tokens / sum(r.chunks for r in results),
        "output_tok_s": tokens / wall_s,
    }


def main() -> None:
    import torch

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    log = Path(tempfile.mkdtemp(prefix="atom-serving-overhead-")) / "server.log"
    # The server loads while the engine below does.
    server = start_server(ARGS.model, ARGS.max_model_len, log)
    try:
        engine = load_engine(ARGS.model)
        n1 = ARGS.num_prompts
        prompts = [chat_prompt(engine, f"Request {i}. {PROMPT}")
                   for i in range(n1 + ARGS.concurrency)]
        conc1, batch = prompts[:n1], prompts[n1:]
        server.wait_ready()
        m = asyncio.run(measure(engine, server.base_url, conc1, batch))
    finally:
        server.stop()
    t_total = time.perf_counter() - t0
    load_after = os.getloadavg()

    s1 = summarize(m["srv1"], sum(r.latency for r in m["srv1"]))
    s64 = summarize(m["srv64"], m["srv64_s"])
    eng1_tpot = statistics.mean(o["tpot"] for o in m["eng1"]) * 1e3
    eng1_ttft = statistics.mean(o["ttft"] for o in m["eng1"]) * 1e3
    pair_ratios = [r.tpot / o["tpot"] for r, o in zip(m["srv1"], m["eng1"])]
    eng64_tpot = statistics.mean(o["tpot"] for o in m["eng64"]) * 1e3
    eng64_tok_s = sum(o["num_tokens_output"] for o in m["eng64"]) / m["eng64_s"]
    added = (s1["mean_tpot_ms"] / eng1_tpot - 1) * 100
    added64 = (s64["mean_tpot_ms"] / eng64_tpot - 1) * 100
    merge = s64["mean_itl_ms"] / s64["mean_tpot_ms"]

    model = ARGS.model or "embedded SmolLM2-135M-Instruct (GGUF, fp32)"
    print(f"\n{model}, {os.cpu_count()} CPUs ({cpu_name()}), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); prompts ~{len(conc1[0])} tokens, greedy, "
          f"ignore_eos; load average {load_before[0]:.2f} -> {load_after[0]:.2f}\n")
    print(f"concurrency 1 ({n1} requests x {ARGS.output_len} tokens, "
          "engine and server alternating)\n")
    print(markdown_table(["", "TPOT ms", "TTFT ms", "mean ITL ms", "tokens per chunk"], [
        ["LLMEngine (in-process)", f"{eng1_tpot:.2f}", f"{eng1_ttft:.1f}", "", ""],
        ["server, engine clock", f"{s1['server_reported_tpot_ms']:.2f}",
         f"{s1['server_reported_ttft_ms']:.1f}", "", ""],
        ["server, client clock", f"{s1['mean_tpot_ms']:.2f}", f"{s1['mean_ttft_ms']:.1f}",
         f"{s1['mean_itl_ms']:.2f}", f"{s1['tokens_per_chunk']:.2f}"]]))
    print(f"\nserver adds {added:+.1f}% to TPOT (median of per-request ratios "
          f"{(statistics.median(pair_ratios) - 1) * 100:+.1f}%)\n")

    print(f"concurrency {ARGS.concurrency} ({len(batch)} requests x "
          f"{ARGS.concurrent_output_len} tokens)\n")
    print(markdown_table(
        ["mean ITL ms", "mean TPOT ms", "ITL/TPOT", "tokens per chunk", "p99 ITL ms", "TTFT ms",
         "tok/s", "engine TPOT ms", "engine tok/s"],
        [[f"{s64['mean_itl_ms']:.2f}", f"{s64['mean_tpot_ms']:.2f}", f"{merge:.2f}",
          f"{s64['tokens_per_chunk']:.2f}", f"{s64['p99_itl_ms']:.1f}",
          f"{s64['mean_ttft_ms']:.0f}", f"{s64['output_tok_s']:.1f}", f"{eng64_tpot:.2f}",
          f"{eng64_tok_s:.1f}"]]))
    print(f"\n(engine = the same prompts as one LLMEngine.generate batch; server adds "
          f"{added64:+.1f}% to its TPOT)")

    out = {
        "host": {"torch_threads": torch.get_num_threads(),
                 "load_average_before": load_before[0], "load_average_after": load_after[0]},
        "model": model, "prompt_tokens": len(conc1[0]),
        "conc1": {"num_prompts": n1, "output_len": ARGS.output_len, "server": s1,
                  "engine_tpot_ms": eng1_tpot, "engine_ttft_ms": eng1_ttft,
                  "server_adds_tpot_pct": added, "per_request_tpot_ratios": pair_ratios},
        "concurrent": {"concurrency": ARGS.concurrency, "output_len": ARGS.concurrent_output_len,
                       "server": s64, "itl_tpot_ratio": merge, "engine_batch_tpot_ms": eng64_tpot,
                       "engine_batch_tok_s": eng64_tok_s, "server_adds_tpot_pct": added64},
        "seconds": t_total,
    }
    path = write_json(ARGS.json, out)
    print(f"\nwrote {path} ({t_total:.0f} s)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="HF dir or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--output-len", type=int, default=64,
                        help="tokens per request at concurrency 1")
    parser.add_argument("--num-prompts", type=int, default=6, help="requests at concurrency 1")
    parser.add_argument("--concurrency", type=int, default=64,
                        help="streams at once (and requests)")
    parser.add_argument("--concurrent-output-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--json", default="bench/results/serving_overhead.json")
    ARGS = parser.parse_args()
    main()
