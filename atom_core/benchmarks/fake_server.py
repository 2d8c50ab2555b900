"""A server test double that streams instantly, to measure the benchmark client's own ceiling.

    python -m atom_core.benchmarks.fake_server --port 8123 [--chunk-interval-ms 0]

It answers every backend the client speaks (/v1/completions, /v1/chat/completions,
/generate_stream for TGI and TRT-LLM, /generate for DeepSpeed-MII) with ``max_tokens``
output chunks of one token each (``--tokens-per-chunk`` merges them, as a backlogged
server does), followed by a usage chunk and ``[DONE]``. Frames are pre-encoded and, with
no interval, written in one call, so the server spends next to nothing per chunk and the
client's parsing is what is measured. /start_profile, /stop_profile and /metrics count calls.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
from dataclasses import dataclass

from aiohttp import web

COUNTERS = web.AppKey("counters", dict)


@dataclass
class FakeConfig:
    tokens_per_chunk: int = 1
    chunk_interval_s: float = 0.0  # pause between chunks (0: the whole stream in one write)
    first_chunk_delay_s: float = 0.0  # "prefill" before the first chunk


def _frame(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _tgi_frame(obj: dict) -> bytes:
    return b"data:" + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@functools.lru_cache(maxsize=256)
def stream_frames(
    kind: str, n_tokens: int, tokens_per_chunk: int, prompt_tokens: int
) -> tuple[bytes, ...]:
    """The frames of one response: ``ceil(n_tokens / tokens_per_chunk)`` chunks, then the end."""
    sizes = [min(tokens_per_chunk, n_tokens - i) for i in range(0, n_tokens, tokens_per_chunk)]
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens,
             "total_tokens": prompt_tokens + n_tokens}
    frames: list[bytes] = []
    if kind == "completions":
        for k in sizes:
            frames.append(_frame({"id": "cmpl-fake", "object": "text_completion", "model": "fake",
                                  "choices": [{"index": 0, "text": "x" * k,
                                               "finish_reason": None}]}))
        frames.append(_frame({"id": "cmpl-fake", "object": "text_completion", "model": "fake",
                              "choices": [], "usage": usage}))
        frames.append(b"data: [DONE]\n\n")
    elif kind == "chat":
        for j, k in enumerate(sizes):
            delta = {"role": "assistant", "content": "x" * k} if j == 0 else {"content": "x" * k}
            frames.append(_frame({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                                  "model": "fake",
                                  "choices": [{"index": 0, "delta": delta,
                                               "finish_reason": None}]}))
        frames.append(_frame({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                              "model": "fake", "choices": [], "usage": usage}))
        frames.append(b"data: [DONE]\n\n")
    elif kind == "tgi":
        done = 0
        for j, k in enumerate(sizes):
            done += k
            last = j == len(sizes) - 1
            frames.append(_tgi_frame({"token": {"text": "x" * k},
                                      "generated_text": "x" * done if last else None,
                                      "details": {"generated_tokens": n_tokens} if last else None}))
    elif kind == "trt":
        done = 0
        for k in sizes:
            done += k
            frames.append(_tgi_frame({"text_output": "x" * done}))
    else:
        raise ValueError(kind)
    return tuple(frames)


def build_app(config: FakeConfig | None = None) -> web.Application:
    cfg = config or FakeConfig()
    counters = {"start_profile": 0, "stop_profile": 0, "requests": 0}

    async def stream(
        request: web.Request, kind: str, n_tokens: int, prompt_tokens: int
    ) -> web.StreamResponse:
        counters["requests"] += 1
        frames = stream_frames(kind, n_tokens, cfg.tokens_per_chunk, prompt_tokens)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if cfg.first_chunk_delay_s:
            await asyncio.sleep(cfg.first_chunk_delay_s)
        if cfg.chunk_interval_s <= 0:
            await resp.write(b"".join(frames))
        else:
            for i, frame in enumerate(frames):
                if i:
                    await asyncio.sleep(cfg.chunk_interval_s)
                await resp.write(frame)
        await resp.write_eof()
        return resp

    def prompt_tokens(text: object) -> int:
        return len(text) if isinstance(text, (str, list)) else 0

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return await stream(request, "completions", int(body.get("max_tokens") or 16),
                            prompt_tokens(body.get("prompt")))

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        content = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        return await stream(request, "chat", int(n), len(content))

    async def generate_stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if "inputs" in body:  # TGI
            return await stream(request, "tgi", int(body["parameters"]["max_new_tokens"]), 0)
        return await stream(request, "trt", int(body["max_tokens"]), 0)

    async def mii(request: web.Request) -> web.Response:
        body = await request.json()
        counters["requests"] += 1
        return web.json_response({"text": ["x" * int(body.get("max_tokens") or 16)]})

    def control(name: str):
        async def handler(request: web.Request) -> web.Response:
            counters[name] += 1
            return web.json_response({"status": "ok"})
        return handler

    async def metrics(request: web.Request) -> web.Response:
        return web.json_response(counters)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app[COUNTERS] = counters
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_post("/generate", mii)
    app.router.add_post("/start_profile", control("start_profile"))
    app.router.add_post("/stop_profile", control("stop_profile"))
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


async def start(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` in the running loop; returns the runner and the bound port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    # A deep accept backlog: a thousand clients connect in the same instant.
    site = web.TCPSite(runner, host, port, backlog=8192)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--chunk-interval-ms", type=float, default=0.0)
    parser.add_argument("--first-chunk-delay-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    cfg = FakeConfig(args.tokens_per_chunk, args.chunk_interval_ms / 1000,
                     args.first_chunk_delay_ms / 1000)

    async def serve() -> None:
        runner, port = await start(build_app(cfg), args.host, args.port)
        print(f"fake server on http://{args.host}:{port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
