"""Flags of ``atom bench serve`` (vLLM's benchmark_serving names and defaults).

Kept free of heavy imports so that ``atom --help`` stays fast.
"""

from __future__ import annotations

import argparse

BACKENDS = ("tgi", "vllm", "lmdeploy", "deepspeed-mii", "openai", "openai-chat", "tensorrt-llm",
            "scalellm", "sglang")
DATASETS = ("sharegpt", "burstgpt", "sonnet", "random", "hf")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DESCRIPTION = """\
Benchmark a running server's online serving: vLLM's benchmark_serving flags, timing and
printed block. Failed requests are counted in the block and their first distinct errors
printed after it.

    atom bench serve --model NAME --base-url http://localhost:8000 \\
        --dataset-name random --random-input-len 1024 --random-output-len 128

The tokenizer that builds and counts the prompts: --tokenizer's local files when given.
Without it, against atom serve (its GET /v1/models card says so), the server's own,
through POST /tokenize and /detokenize: the ids the server counts, its --chat-template
included, from any machine and with nothing to load. Against other servers, --model's
local files. Only atom serve is asked for /debug/mtp_stats (speculative decoding's
acceptance), so no other server logs a 404 for it. Set OPENAI_API_KEY for a server started
with --api-key.
"""


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server")
    g.add_argument("--backend", default="vllm", choices=BACKENDS,
                   help="request protocol (default: vllm)")
    g.add_argument("--model", required=True,
                   help="model name or path (sent as 'model'; where the tokenizer is read from "
                        "when neither --tokenizer nor the server gives one)")
    g.add_argument("--served-model-name", default=None,
                   help="the 'model' field to send, if not --model")
    g.add_argument("--base-url", default=None,
                   help="server base URL, e.g. http://localhost:8000")
    g.add_argument("--host", default="127.0.0.1", help="server host when --base-url is not set")
    g.add_argument("--port", type=int, default=8000, help="server port when --base-url is not set")
    g.add_argument("--endpoint", default=None,
                   help="API path (default: /v1/completions; /v1/chat/completions for openai-chat; "
                        "/generate_stream for tgi and tensorrt-llm)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer path; a .gguf file works (default: against atom serve, the "
                        "server's own tokenizer through its /tokenize and /detokenize; against "
                        "other servers, --model's local files)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let the tokenizer run its own code")

    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="sharegpt", choices=DATASETS,
                   help="prompt source (default: sharegpt)")
    g.add_argument("--dataset-path", default=None, help="local dataset file or directory")
    g.add_argument("--num-prompts", type=int, default=1000,
                   help="number of requests (default: 1000)")
    g.add_argument("--seed", type=int, default=0, help="seed for prompts and arrival times")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed output length for sharegpt")
    g.add_argument("--sonnet-input-len", type=int, default=550, help="sonnet prompt tokens")
    g.add_argument("--sonnet-output-len", type=int, default=150, help="sonnet output tokens")
    g.add_argument("--sonnet-prefix-len", type=int, default=200,
                   help="sonnet prefix tokens shared by all prompts")
    g.add_argument("--hf-subset", default=None, help="subset (config name) of a local HF dataset")
    g.add_argument("--hf-split", default="train", help="split of a local HF dataset")
    g.add_argument("--hf-output-len", type=int, default=None, help="fixed output length for hf")

    g = parser.add_argument_group("random dataset")
    g.add_argument("--random-input-len", type=int, default=1024,
                   help="input tokens (default: 1024)")
    g.add_argument("--random-output-len", type=int, default=128,
                   help="output tokens (default: 128)")
    g.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths uniform in [len * ratio, len] (default: 1.0, fixed)")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="random tokens shared by every prompt")
    g.add_argument("--use-chat-template", action="store_true",
                   help="wrap random prompts in the chat template")

    g = parser.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (default: inf, all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times: 1 = Poisson, <1 burstier, "
                        ">1 steadier")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS")
    g.add_argument("--logprobs", type=int, default=None, help="logprobs per token to request")
    g.add_argument("--best-of", type=int, default=1,
                   help="best_of to request (backends that take it)")
    g.add_argument("--num-warmups", type=int, default=0,
                   help="requests sent (and not measured) before the run")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    g.add_argument("--profile", action="store_true",
                   help="POST /start_profile before and /stop_profile after")

    g = parser.add_argument_group("results")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="comma-separated metrics to report: ttft,tpot,itl,e2el "
                        "(default: ttft,tpot,itl)")
    g.add_argument("--metric-percentiles", default="99",
                   help="comma-separated percentiles (default: 99)")
    g.add_argument("--goodput", nargs="+", default=None,
                   help="SLOs as KEY:VALUE in ms for ttft, tpot, e2el (e.g. ttft:100 tpot:50)")
    g.add_argument("--save-result", action="store_true",
                   help="write the results (with per-request records) as JSON")
    g.add_argument("--result-dir", default=None, help="directory of the JSON (default: current)")
    g.add_argument("--result-filename", default=None,
                   help="JSON file name (default: backend-rate-model-date.json)")
    g.add_argument("--metadata", nargs="*", default=None, help="KEY=VALUE pairs added to the JSON")
    return parser
