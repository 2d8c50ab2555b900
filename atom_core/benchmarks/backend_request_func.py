"""One async function per serving backend: send a request, time every streamed chunk.

Timing follows vLLM's benchmark client: TTFT is the time from sending the request to the
first chunk that carries output, ITL is sampled once per later chunk (so a server that
merges N tokens into one chunk shows ITL inflated by about N: compare TPOT), latency is
the time of the last output chunk. Output token counts come from the server's ``usage``
when it reports one (we ask for it with ``stream_options.include_usage``).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)

try:  # msgspec (an engine dependency) decodes a chunk ~2x faster than json.loads
    from msgspec.json import decode as _decode
except ImportError:  # pragma: no cover
    _decode = json.loads


@dataclass
class RequestFuncInput:
    prompt: str
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    model_name: str | None = None
    logprobs: int | None = None
    best_of: int = 1
    ignore_eos: bool = False
    extra_body: dict[str, Any] | None = None


@dataclass
class RequestFuncOutput:
    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int | None = None  # the server's usage.completion_tokens, if it said
    server_prompt_tokens: int | None = None  # the server's usage.prompt_tokens, if it said
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    tpot: float = 0.0
    prompt_len: int = 0
    start_time: float = 0.0  # time.perf_counter() when the request was sent
    error: str = ""


RequestFunc = Callable[..., Awaitable[RequestFuncOutput]]

_session: aiohttp.ClientSession | None = None


def make_session(limit: int = 0, headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """One pooled session for the whole run: a session per request (as older clients do)
    costs a connector and a DNS lookup each, and caps what one process can drive.
    ``limit=0`` leaves the number of connections to --max-concurrency; ``headers`` go
    with every request (the API key)."""
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, ttl_dns_cache=300,
                                     keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, timeout=AIOHTTP_TIMEOUT, trust_env=True,
                                 headers=headers)


def set_session(session: aiohttp.ClientSession | None) -> None:
    """Share ``session`` with every request function (None: each request opens its own)."""
    global _session
    _session = session


class _SessionScope:
    """The shared session if there is one, else a fresh one closed after the request."""

    def __init__(self) -> None:
        self.own: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> aiohttp.ClientSession:
        if _session is not None and not _session.closed:
            return _session
        self.own = aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT, trust_env=True)
        return self.own

    async def __aexit__(self, *exc: object) -> None:
        if self.own is not None:
            await self.own.close()


class _Timer:
    """TTFT on the first output chunk, one ITL sample per later one."""

    def __init__(self, out: RequestFuncOutput) -> None:
        self.out = out
        self.st = out.start_time
        self.last = self.st
        self.first = True

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.first:
            self.first = False
            self.out.ttft = now - self.st
        else:
            self.out.itl.append(now - self.last)
        self.last = now

    def finish(self) -> None:
        self.out.latency = self.last - self.st


def _sse_payload(line: bytes) -> bytes | None:
    """The data of one SSE line; None for blank lines, comments, [DONE] and other fields."""
    line = line.strip()
    if not line or line.startswith(b":"):
        return None
    if line.startswith(b"data:"):
        line = line[5:].lstrip()
    elif line.startswith((b"event:", b"id:", b"retry:")):
        return None
    if line == b"[DONE]":
        return None
    return line


def _sse_lines(data: bytes, tail: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines of ``tail + data`` as SSE payloads, and the incomplete rest."""
    lines = (tail + data if tail else data).split(b"\n")
    rest = lines.pop()
    return [p for p in map(_sse_payload, lines) if p is not None], rest


def _http_error(status: int, body: bytes) -> str:
    return f"HTTP {status}: {body.decode(errors='replace')[:500]}"


def _failed(out: RequestFuncOutput) -> RequestFuncOutput:
    out.success = False
    out.error = "".join(traceback.format_exception(*sys.exc_info()))
    return out


def _done(out: RequestFuncOutput, timer: _Timer, text: list[str], pbar: Any) -> RequestFuncOutput:
    out.generated_text = "".join(text)
    timer.finish()
    if timer.first and not out.error:
        out.error = ("Never received a valid chunk to calculate TTFT. "
                     "This response will be marked as failed!")
    out.success = not timer.first and not out.error
    if pbar is not None:
        pbar.update(1)
    return out


def _usage(out: RequestFuncOutput, data: dict[str, Any]) -> None:
    usage = data.get("usage")
    if usage:
        out.output_tokens = usage.get("completion_tokens", out.output_tokens)
        out.server_prompt_tokens = usage.get("prompt_tokens", out.server_prompt_tokens)


class StreamError(Exception):
    """The server reported an error inside the stream (an SSE error frame)."""


ChunkHandler = Callable[[dict[str, Any], _Timer, list[str], RequestFuncOutput], None]


async def _request_stream(rfi: RequestFuncInput, payload: dict[str, Any], pbar: Any,
                          on_data: ChunkHandler) -> RequestFuncOutput:
    """POST ``payload`` and feed every SSE data object to ``on_data`` as it arrives."""
    out = RequestFuncOutput(prompt_len=rfi.prompt_len)
    text: list[str] = []
    async with _SessionScope() as session:
        out.start_time = time.perf_counter()
        timer = _Timer(out)
        try:
            async with session.post(rfi.api_url, json=payload) as resp:
                if resp.status != 200:
                    out.error = _http_error(resp.status, await resp.read())
                else:
                    # Whatever arrived, split here: ~1.6x cheaper per chunk than aiohttp's
                    # line iterator (one await per read, not per line). Chunks that arrived in
                    # one read are timestamped in the same instant either way.
                    tail = b""
                    async for data in resp.content.iter_any():
                        payloads, tail = _sse_lines(data, tail)
                        for raw in payloads:
                            on_data(_decode(raw), timer, text, out)
                    for raw in _sse_lines(b"\n", tail)[0]:
                        on_data(_decode(raw), timer, text, out)
        except StreamError as exc:
            out.error = str(exc)
        except Exception:
            _failed(out)
    return _done(out, timer, text, pbar)


def _raise_on_error(data: dict[str, Any]) -> None:
    if "error" in data and not data.get("choices"):
        raise StreamError(json.dumps(data["error"]))


def _on_completion_chunk(
    data: dict[str, Any], timer: _Timer, text: list[str], out: RequestFuncOutput
) -> None:
    _raise_on_error(data)
    if choices := data.get("choices"):
        # The text may be empty (a special token): still a token's chunk.
        timer.chunk()
        text.append(choices[0].get("text") or "")
    _usage(out, data)


def _on_chat_chunk(
    data: dict[str, Any], timer: _Timer, text: list[str], out: RequestFuncOutput
) -> None:
    _raise_on_error(data)
    if choices := data.get("choices"):
        delta = choices[0].get("delta") or {}
        piece = delta.get("content") or delta.get("reasoning_content") or ""
        # A role-only opener sent before anything was generated is not a token.
        if piece or delta.get("tool_calls") or "role" not in delta:
            timer.chunk()
            text.append(piece)
    _usage(out, data)


def _on_tgi_chunk(
    data: dict[str, Any], timer: _Timer, text: list[str], out: RequestFuncOutput
) -> None:
    timer.chunk()
    if data.get("generated_text") is not None:  # TGI sends the whole text with the last token
        text[:] = [data["generated_text"]]
    details = data.get("details") or {}
    out.output_tokens = details.get("generated_tokens", out.output_tokens)


def _on_trt_chunk(
    data: dict[str, Any], timer: _Timer, text: list[str], out: RequestFuncOutput
) -> None:
    timer.chunk()
    text[:] = [data.get("text_output", "")]  # accumulate_tokens: each chunk has all so far


async def async_request_openai_completions(
    request_func_input: RequestFuncInput, pbar: Any = None
) -> RequestFuncOutput:
    rfi = request_func_input
    if not rfi.api_url.endswith(("completions", "profile")):
        raise ValueError("the OpenAI Completions API URL must end with 'completions' or 'profile'")
    payload: dict[str, Any] = {
        "model": rfi.model_name or rfi.model,
        "prompt": rfi.prompt,
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": rfi.output_len,
        "logprobs": rfi.logprobs,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if rfi.best_of > 1:
        payload["best_of"] = rfi.best_of
    if rfi.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(rfi.extra_body or {})
    return await _request_stream(rfi, payload, pbar, _on_completion_chunk)


async def async_request_openai_chat_completions(
    request_func_input: RequestFuncInput, pbar: Any = None
) -> RequestFuncOutput:
    rfi = request_func_input
    if not rfi.api_url.endswith(("chat/completions", "profile")):
        raise ValueError("the OpenAI Chat Completions API URL must end with 'chat/completions'")
    payload: dict[str, Any] = {
        "model": rfi.model_name or rfi.model,
        "messages": [{"role": "user", "content": rfi.prompt}],
        "temperature": 0.0,
        "max_completion_tokens": rfi.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if rfi.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(rfi.extra_body or {})
    return await _request_stream(rfi, payload, pbar, _on_chat_chunk)


async def async_request_tgi(
    request_func_input: RequestFuncInput, pbar: Any = None
) -> RequestFuncOutput:
    """Text Generation Inference's ``/generate_stream``."""
    rfi = request_func_input
    if not rfi.api_url.endswith("generate_stream"):
        raise ValueError("the TGI URL must end with 'generate_stream'")
    params: dict[str, Any] = {
        "max_new_tokens": rfi.output_len,
        "do_sample": True,
        "temperature": 0.01,  # TGI refuses 0.0
        "top_p": 0.99,  # TGI refuses 1.0
        "truncate": rfi.prompt_len,
        "ignore_eos_token": rfi.ignore_eos,
    }
    if rfi.best_of > 1:
        params["best_of"] = rfi.best_of
    payload = {"inputs": rfi.prompt, "parameters": params}
    return await _request_stream(rfi, payload, pbar, _on_tgi_chunk)


async def async_request_trt_llm(
    request_func_input: RequestFuncInput, pbar: Any = None
) -> RequestFuncOutput:
    """TensorRT-LLM (Triton) ``generate_stream`` with accumulated text."""
    rfi = request_func_input
    if not rfi.api_url.endswith("generate_stream"):
        raise ValueError("the TRT-LLM URL must end with 'generate_stream'")
    payload: dict[str, Any] = {
        "accumulate_tokens": True,
        "text_input": rfi.prompt,
        "temperature": 0.0,
        "top_p": 1.0,
        "max_tokens": rfi.output_len,
        "stream": True,
    }
    if rfi.ignore_eos:
        payload["min_length"] = rfi.output_len
    return await _request_stream(rfi, payload, pbar, _on_trt_chunk)


async def async_request_deepspeed_mii(
    request_func_input: RequestFuncInput, pbar: Any = None
) -> RequestFuncOutput:
    """DeepSpeed-MII's RESTful API: no streaming, so TTFT is the whole latency and ITL is empty."""
    rfi = request_func_input
    payload = {
        "prompt": rfi.prompt,
        "max_tokens": rfi.output_len,
        "temperature": 0.01,  # MII refuses 0.0
        "top_p": 1.0,
    }
    out = RequestFuncOutput(prompt_len=rfi.prompt_len)
    text: list[str] = []
    async with _SessionScope() as session:
        out.start_time = time.perf_counter()
        timer = _Timer(out)
        try:
            async with session.post(rfi.api_url, json=payload) as resp:
                body = await resp.read()
                if resp.status != 200:
                    out.error = _http_error(resp.status, body)
                else:
                    timer.chunk()
                    data = json.loads(body)
                    generated = data.get("text", data) if isinstance(data, dict) else data
                    text.append(generated[0] if isinstance(generated, list) else str(generated))
        except Exception:
            _failed(out)
    return _done(out, timer, text, pbar)


ASYNC_REQUEST_FUNCS: dict[str, RequestFunc] = {
    "tgi": async_request_tgi,
    "vllm": async_request_openai_completions,
    "lmdeploy": async_request_openai_completions,
    "deepspeed-mii": async_request_deepspeed_mii,
    "openai": async_request_openai_completions,
    "openai-chat": async_request_openai_chat_completions,
    "tensorrt-llm": async_request_trt_llm,
    "scalellm": async_request_openai_completions,
    "sglang": async_request_openai_completions,
}


async def post_control(url: str, timeout_s: float = AIOHTTP_TIMEOUT.total or 0) -> tuple[bool, str]:
    """POST a body-less control request (/start_profile, /stop_profile); (ok, response text)."""
    async with _SessionScope() as session:
        try:
            async with session.post(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200, (await resp.text())[:500]
        except Exception as exc:
            return False, repr(exc)


async def get_json(url: str, timeout_s: float = 10.0) -> Any | None:
    """GET ``url`` as JSON; None on any failure (the endpoint is optional)."""
    async with _SessionScope() as session:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    return None
                return await resp.json(content_type=None)
        except Exception:
            return None
