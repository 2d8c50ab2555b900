"""Benchmark an OpenAI-compatible (or TGI/TRT-LLM/MII) server's online serving performance.

    atom bench serve --model PATH --base-url http://localhost:8000 \\
        --dataset-name random --random-input-len 1024 --random-output-len 128 \\
        --num-prompts 1000 --request-rate inf --ignore-eos
    python -m atom_core.benchmarks.benchmark_serving ...   (the same flags)

Adapted from vLLM's benchmark_serving: same flags, same timing, same printed block, plus
"Concurrency:" and "ITL/TPOT (merge factor):". One process drives thousands of concurrent
streams: one pooled aiohttp session, no per-request connector.

The tokenizer, the API key and what is asked of the server are as ``cli_args.DESCRIPTION``
(the --help text) says: without --tokenizer, an ATOM server's own tokenizer
(tokenizer.ServerTokenizer, found by server_info).

Every argument is checked before the run starts (values, files, the server answering
on its port); what is wrong is a ConfigError, which ``atom`` prints as one line. Failed
requests are counted in the block, and their first distinct errors printed after it. A
run in which every request failed (a wrong --endpoint or --served-model-name) prints its
block, then fails the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import resource
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from tqdm import tqdm

from atom_core.benchmarks.arrivals import arrival_intervals, paced
from atom_core.benchmarks.backend_request_func import (
    ASYNC_REQUEST_FUNCS,
    RequestFuncInput,
    RequestFuncOutput,
    get_json,
    make_session,
    post_control,
    set_session,
)
from atom_core.benchmarks.cli_args import DESCRIPTION, add_cli_args
from atom_core.benchmarks.datasets import SampleRequest, get_samples
from atom_core.benchmarks.metrics import (
    calculate_metrics,
    format_result,
    parse_goodput,
    result_dict,
)
from atom_core.benchmarks.server_info import (
    OPENAI_BACKENDS,
    JsonClient,
    ServedModel,
    auth_headers,
    served_model,
)
from atom_core.benchmarks.tokenizer import ServerTokenizer, get_tokenizer
from atom_core.errors import AtomError, ConfigError

DEFAULT_ENDPOINTS = {"openai-chat": "/v1/chat/completions", "tgi": "/generate_stream",
                     "tensorrt-llm": "/generate_stream"}
SHOWN_ERRORS = 5  # distinct errors of failed requests printed after the block


def raise_fd_limit() -> None:
    """Every stream in flight is a socket: lift the soft open-file limit (often 1024) to the
    hard one, or a few thousand concurrent requests fail with EMFILE on the client."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            print(f"warning: open-file limit stays at {soft} ({exc}); more concurrent "
                  "streams than that will fail to connect", file=sys.stderr)


async def spec_decode_stats(base_url: str) -> tuple[float | None, float | None]:
    """(accept length, acceptance rate) from GET /debug/mtp_stats; (None, None) when
    speculative decoding is off (or the server does not answer)."""
    stats = await get_json(f"{base_url}/debug/mtp_stats")
    if not isinstance(stats, dict) or not stats.get("enabled", True):
        return None, None
    length, rate = stats.get("average_tokens_per_forward"), stats.get("acceptance_rate")
    return (float(length) if length is not None else None,
            float(rate) if rate is not None else None)


def _request_input(s: SampleRequest, backend: str, api_url: str, model_id: str,
                   model_name: str | None, logprobs: int | None, best_of: int,
                   ignore_eos: bool) -> RequestFuncInput:
    # openai-chat servers apply the chat template themselves: send the bare prompt.
    prompt = s.raw_prompt if backend == "openai-chat" and s.raw_prompt is not None else s.prompt
    return RequestFuncInput(prompt=prompt, api_url=api_url, prompt_len=s.prompt_len,
                            output_len=s.expected_output_len, model=model_id, model_name=model_name,
                            logprobs=logprobs, best_of=best_of, ignore_eos=ignore_eos)


async def benchmark(
    *,
    backend: str,
    api_url: str,
    base_url: str,
    model_id: str,
    model_name: str | None,
    requests: list[SampleRequest],
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    logprobs: int | None = None,
    best_of: int = 1,
    ignore_eos: bool = False,
    num_warmups: int = 0,
    profile: bool = False,
    disable_tqdm: bool = False,
    selected_percentile_metrics: list[str] | None = None,
    selected_percentiles: list[float] | None = None,
    goodput: dict[str, float] | None = None,
    tokenizer: Any = None,
    probe_spec_decode: bool = False,
) -> dict[str, Any]:
    """Send ``requests`` at the given arrival process; print the result block and the
    failed requests' first errors; return it as a dict. ``probe_spec_decode``: read
    /debug/mtp_stats after the run (only a server known to have it is asked)."""
    if backend not in ASYNC_REQUEST_FUNCS:
        raise ValueError(f"unknown backend {backend!r}")
    request_func = ASYNC_REQUEST_FUNCS[backend]
    selected_metrics = selected_percentile_metrics or ["ttft", "tpot", "itl"]
    percentiles = selected_percentiles or [99.0]
    inputs = [_request_input(s, backend, api_url, model_id, model_name, logprobs, best_of,
                             ignore_eos)
              for s in requests]
    session = make_session(limit=max_concurrency or 0, headers=auth_headers())
    set_session(session)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(rfi: RequestFuncInput, pbar: Any) -> RequestFuncOutput:
        if semaphore is None:
            return await request_func(request_func_input=rfi, pbar=pbar)
        async with semaphore:
            return await request_func(request_func_input=rfi, pbar=pbar)

    try:
        if num_warmups > 0:
            print(f"Warming up with {num_warmups} requests...")
            await asyncio.gather(*(limited(inputs[0], None) for _ in range(num_warmups)))
            print("Warmup completed.")
        if profile:
            print("Starting profiler...")
            ok, msg = await post_control(f"{base_url}/start_profile")
            print("Profiler started" if ok else f"Profiler failed to start: {msg}")

        distribution = "Poisson process" if burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {request_rate}")
        print(f"Burstiness factor: {burstiness} ({distribution})")
        print(f"Maximum request concurrency: {max_concurrency}")
        intervals = arrival_intervals(len(inputs), request_rate, burstiness, seed)
        pbar = tqdm(total=len(inputs), disable=disable_tqdm)
        start = time.perf_counter()
        dispatch: list[float] = []
        tasks = []
        async for _, rfi in paced(inputs, intervals):
            dispatch.append(time.perf_counter() - start)
            tasks.append(asyncio.create_task(limited(rfi, pbar)))
        outputs: list[RequestFuncOutput] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        pbar.close()

        if profile:
            print("Stopping profiler...")
            ok, msg = await post_control(f"{base_url}/stop_profile")
            print("Profiler stopped" if ok else f"Profiler failed to stop: {msg}")
        accept_length, acceptance_rate = (
            await spec_decode_stats(base_url) if probe_spec_decode else (None, None))
    finally:
        set_session(None)
        await session.close()

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else 0

    metrics, records = calculate_metrics(outputs, duration, percentiles, goodput,
                                         count_tokens if tokenizer is not None else None)
    block = format_result(metrics, selected_metrics, goodput, accept_length, acceptance_rate)
    print("\n".join(block + error_summary([o.error for o in outputs if not o.success])))
    result = result_dict(metrics, records, selected_metrics, goodput)
    sent = [o.start_time - start for o in outputs]
    result.update(
        accept_length=accept_length,
        acceptance_rate=acceptance_rate,
        tokenizer_input_lens=[s.prompt_len for s in requests],
        server_input_lens=[o.server_prompt_tokens for o in outputs],
        # When each request was due by the arrival process, and when it was actually sent
        # (later under --max-concurrency); both in seconds from the start of the run.
        dispatch_times=dispatch,
        start_times=sent,
        inter_arrival_times=np.diff(dispatch).tolist(),
        generated_texts=[o.generated_text for o in outputs],
        errors=[o.error for o in outputs],
    )
    return result


def _percentiles(spec: str) -> list[float]:
    try:
        values = [float(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ConfigError(f"--metric-percentiles must be numbers in [0, 100], got {spec!r}")
    return values


def _percentile_metrics(spec: str) -> list[str]:
    names = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in names if m not in ("ttft", "tpot", "itl", "e2el")]
    if bad:
        raise ConfigError(f"--percentile-metrics: unknown {', '.join(bad)} (ttft, tpot, itl, e2el)")
    return names


@contextmanager
def refused_as(what: str | None = None) -> Iterator[None]:
    """What the block raises about a bad input (a missing file, a malformed value) as a
    ConfigError, its message prefixed with ``what`` it was about (when it does not say)."""
    try:
        yield
    except AtomError:
        raise
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(f"{what}: {exc}" if what else str(exc)) from exc


def load_tokenizer(
    args: argparse.Namespace, served: ServedModel | None = None, client: JsonClient | None = None
) -> tuple[Any, str]:
    """The tokenizer and the name the results give it: --tokenizer's local files; else the
    server's own, when it is ATOM's (``served``: its /v1/models card, ``client``: a
    connection to it); else --model's local files."""
    if not args.tokenizer and served is not None and served.tokenizer is not None:
        assert client is not None
        return ServerTokenizer(client, served.tokenizer), f"{client.base_url}/tokenize"
    name = args.tokenizer or args.model
    flag = "--tokenizer" if args.tokenizer else "--model"
    path = os.path.expanduser(name)
    if (os.path.isabs(path) or name.startswith(".")) and not os.path.exists(path):
        raise ConfigError(f"{flag} {name}: no such file or directory "
                          "(the tokenizer is read from local files)")
    with refused_as(f"cannot load the tokenizer of {flag} {name}"):
        return get_tokenizer(name, trust_remote_code=args.trust_remote_code), name


def check_args(args: argparse.Namespace) -> None:
    """Refuse the values argparse's types let through but a run cannot take."""
    def need(ok: bool, flag: str, value: Any, what: str) -> None:
        if not ok:
            raise ConfigError(f"{flag} must be {what}, got {value!r}")

    positive, non_negative = "a positive integer", "a non-negative integer"
    need(args.num_prompts >= 1, "--num-prompts", args.num_prompts, positive)
    need(args.request_rate > 0, "--request-rate", args.request_rate, "positive (inf: all at once)")
    need(0 < args.burstiness < math.inf, "--burstiness", args.burstiness, "a positive number")
    need(args.max_concurrency is None or args.max_concurrency >= 1, "--max-concurrency",
         args.max_concurrency, positive)
    need(args.num_warmups >= 0, "--num-warmups", args.num_warmups, non_negative)
    need(args.best_of >= 1, "--best-of", args.best_of, positive)
    need(args.logprobs is None or args.logprobs >= 0, "--logprobs", args.logprobs, non_negative)
    need(1 <= args.port <= 65535, "--port", args.port, "a port number (1-65535)")
    for flag in ("random_input_len", "random_output_len", "sonnet_input_len", "sonnet_output_len"):
        need(getattr(args, flag) >= 1, f"--{flag.replace('_', '-')}", getattr(args, flag), positive)
    for flag in ("random_prefix_len", "sonnet_prefix_len"):
        need(getattr(args, flag) >= 0, f"--{flag.replace('_', '-')}", getattr(args, flag),
             non_negative)
    for flag in ("sharegpt_output_len", "hf_output_len"):
        value = getattr(args, flag)
        need(value is None or value >= 1, f"--{flag.replace('_', '-')}", value, positive)
    need(0 <= args.random_range_ratio <= 1, "--random-range-ratio", args.random_range_ratio,
         "in [0, 1]")
    if args.dataset_name in ("sharegpt", "burstgpt", "hf") and not args.dataset_path:
        raise ConfigError(f"--dataset-name {args.dataset_name} needs --dataset-path (a local file; "
                          "nothing is downloaded)")
    if args.dataset_path and not os.path.exists(os.path.expanduser(args.dataset_path)):
        raise ConfigError(f"--dataset-path {args.dataset_path}: no such file or directory")
    for item in args.metadata or []:
        need("=" in item, "--metadata", item, "KEY=VALUE pairs")
    result_dir_is_file = (args.result_dir and os.path.exists(args.result_dir)
                          and not os.path.isdir(args.result_dir))
    need(not result_dir_is_file, "--result-dir", args.result_dir, "a directory")


def check_reachable(base_url: str, flag: str, timeout_s: float = 5.0) -> None:
    """Refuse a URL that is not http(s), or whose host does not accept a connection."""
    parts = urlsplit(base_url)
    with refused_as(f"{flag} {base_url!r}"):
        port = parts.port  # a malformed port raises ValueError
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{flag} {base_url!r} is not an http:// or https:// URL")
    port = port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise ConfigError(f"cannot reach the server at {base_url} ({flag}): {reason}") from exc


def _first_line(error: str) -> str:
    """A request's error (possibly a whole traceback) as one line: its last line."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no error recorded"


def error_summary(errors: list[str], shown: int = SHOWN_ERRORS) -> list[str]:
    """The failed requests' errors as lines to print after the block: the first ``shown``
    distinct ones (each as one line), in the order they first occurred, with how many
    requests failed with each. Nothing when no request failed."""
    if not errors:
        return []
    counts = Counter(map(_first_line, errors))  # insertion order: first occurrence
    first = f"the first {shown} shown" if len(counts) > shown else "all shown"
    lines = [f"Failed requests: {len(errors)} ({len(counts)} distinct errors, {first})"]
    lines += [f"{n:>6} x {message}" for message, n in list(counts.items())[:shown]]
    return lines


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``atom bench serve`` does: check, sample, run, print, and save if asked."""
    check_args(args)
    with refused_as():  # its messages name --goodput
        goodput = parse_goodput(args.goodput)
    percentiles = _percentiles(args.metric_percentiles)
    metrics = _percentile_metrics(args.percentile_metrics)
    endpoint = args.endpoint or DEFAULT_ENDPOINTS.get(args.backend, "/v1/completions")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    check_reachable(base_url, "--base-url" if args.base_url else "--host/--port")
    api_url = f"{base_url}{endpoint}"
    client = JsonClient(base_url, auth_headers())
    try:
        served = None
        if args.backend in OPENAI_BACKENDS:
            served = served_model(client, args.served_model_name or args.model)
        tokenizer, tokenizer_id = load_tokenizer(args, served, client)
        try:
            requests = get_samples(args, tokenizer)
        except AtomError:
            raise
        except Exception as exc:  # what reading the user's dataset raises is about it
            source = f" (--dataset-path {args.dataset_path})" if args.dataset_path else ""
            raise ConfigError(f"--dataset-name {args.dataset_name}{source}: "
                              f"{type(exc).__name__}: {exc}") from exc
        raise_fd_limit()

        gc.collect()
        gc.freeze()  # the prompts are static: keep the collector from re-scanning them mid-run
        result = asyncio.run(benchmark(
            backend=args.backend, api_url=api_url, base_url=base_url, model_id=args.model,
            model_name=args.served_model_name, requests=requests,
            request_rate=args.request_rate, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, seed=args.seed, logprobs=args.logprobs,
            best_of=args.best_of, ignore_eos=args.ignore_eos, num_warmups=args.num_warmups,
            profile=args.profile, disable_tqdm=args.disable_tqdm,
            selected_percentile_metrics=metrics, selected_percentiles=percentiles,
            goodput=goodput, tokenizer=tokenizer,
            probe_spec_decode=served is not None and served.atom,
        ))
        gc.unfreeze()
    finally:
        client.close()
    if args.save_result:
        save_result(args, result, tokenizer_id)
    if result["completed"] == 0:
        first = next((e for e in result["errors"] if e), "")
        raise ConfigError(f"every one of the {len(result['errors'])} requests to {api_url} failed; "
                          f"the first: {_first_line(first)}")
    return result


def save_result(args: argparse.Namespace, result: dict[str, Any], tokenizer_id: str) -> str:
    now = datetime.now().strftime("%Y%m%d-%H%M%S")
    header: dict[str, Any] = {
        "date": now, "backend": args.backend, "model_id": args.model, "tokenizer_id": tokenizer_id,
        "best_of": args.best_of, "num_prompts": args.num_prompts, "dataset_name": args.dataset_name,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
    }
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"invalid --metadata {item!r}: use KEY=VALUE")
        header[key.strip()] = value.strip()
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or (
        f"{args.backend}-{args.request_rate}qps{concurrency}-{os.path.basename(args.model.rstrip('/'))}-{now}.json"
    )
    path = os.path.join(args.result_dir, name) if args.result_dir else name
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**header, **result}, f)
    print(f"Results saved to {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    from atom_core.entrypoints.cli import AtomArgumentParser

    parser = AtomArgumentParser(prog="atom bench serve", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_cli_args(parser).parse_args(argv)
    try:
        run(args)
    except AtomError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
