"""Messages between the server's frontend and the engine process (msgspec over ZMQ)."""

from __future__ import annotations

import msgspec

from atom_core.engine.sequence import Logprob, RequestTimings
from atom_core.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class Control(msgspec.Struct, tag=True):
    """start_profile | stop_profile | shutdown; answered by a ControlReply."""

    command: str
    call_id: int = 0


class Wake(msgspec.Struct, tag=True):
    """DP attention: another replica of the group was sent a request. An idle replica waits
    on its link for this (or work of its own) rather than polling the group, and on it
    joins the group's agreement at once, so the request's first step does not wait."""


ToEngine = AddRequest | AbortRequests | Control | Wake


class TokenOutput(msgspec.Struct):
    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprob] = []
    prompt_logprobs: list[Logprob | None] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str | None = None  # the engine refused the request
    timings: RequestTimings | None = None  # on the finished output


class SpecDecodeCounts(msgspec.Struct):
    """Speculative decoding's cumulative counts (engine/spec_decode.py)."""

    draft_tokens: int
    accepted_tokens: int
    verifications: int  # sequence-forwards that verified drafts
    accepted_per_position: list[int]


class EngineStats(msgspec.Struct):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int  # cumulative, tokens
    prefix_cache_hits: int  # cumulative, tokens
    prompt_tokens: int  # this step
    generation_tokens: int  # this step
    num_preemptions: int  # cumulative
    spec_decode: SpecDecodeCounts | None = None  # None: no --method


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[TokenOutput]
    stats: EngineStats


class EngineReady(msgspec.Struct, tag=True):
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    architecture: str


class ControlReply(msgspec.Struct, tag=True):
    call_id: int
    ok: bool
    message: str = ""


class EngineFailed(msgspec.Struct, tag=True):
    """The engine could not start (or died with an exception it could report)."""

    message: str


FromEngine = StepOutputs | EngineReady | ControlReply | EngineFailed

encoder = msgspec.msgpack.Encoder()
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
