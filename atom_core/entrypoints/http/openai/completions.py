"""POST /v1/completions: text or token-id prompts, n choices, echo, legacy logprobs.

The plumbing every endpoint shares (model check, fan-in of choices, usage) is
http/generation.py; each prompt passes the engine's check_request once, on the worker
thread that tokenizes it, and its n choices share that check.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from atom_core.engine.request_stream import RequestDelta
from atom_core.engine.sequence import Logprob
from atom_core.engine.validation import check_request
from atom_core.entrypoints.http.engine_api import EngineClientAPI
from atom_core.entrypoints.http.generation import (
    ChoiceTally,
    EngineJob,
    TokenTexts,
    check_constraint,
    check_model,
    choice_params,
    error_frame,
    served_names,
    stream_deltas,
    usage_of,
)
from atom_core.entrypoints.http.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    now,
    random_id,
)
from atom_core.entrypoints.http.prompt_tokens import PromptTokenizer, off_loop
from atom_core.entrypoints.http.sse import DONE_FRAME, data_frame, json_response, sse_response
from atom_core.errors import EngineDeadError
from atom_core.generation_defaults import GenerationDefaults
from atom_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------- completions


def completion_logprobs(
    texts: TokenTexts, token_ids: list[int], entries: list[Logprob | None], offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy logprobs of ``token_ids``; returns the offset after the last token."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, entry in zip(token_ids, entries):
        token = texts(token_id)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(entry.logprob)
            top = {texts(t): lp for t, lp in entry.top}
            top.setdefault(token, entry.logprob)  # the chosen token is always listed
            out.top_logprobs.append(top)
    return out, offset


@dataclass(frozen=True)
class _Prompt:
    text: str  # what echo returns
    token_ids: list[int]


class OpenAIServingCompletion:
    """``await OpenAIServingCompletion(engine).create(request, raw_request)``; ``defaults``
    fill the sampling fields a request leaves out (``--generation-config``)."""

    def __init__(self, engine: EngineClientAPI, model_aliases: Iterable[str] | None = None,
                 defaults: GenerationDefaults | None = None) -> None:
        self.engine = engine
        self.defaults = defaults or GenerationDefaults()
        self.names = served_names(engine, model_aliases)
        self.texts = TokenTexts(engine.tokenizer)
        self.tokens = PromptTokenizer(engine.tokenizer)

    async def create(
        self, request: CompletionRequest, raw_request: Request | None = None
    ) -> Response:
        check_model(request.model, self.names)
        # max_tokens null: as many as fit, which the engine's context cap enforces.
        params = self.defaults.apply(request.to_sampling_params(self.engine.max_model_len),
                                     request.model_fields_set)
        check_constraint(self.engine, params)
        prompts = await off_loop(self._prompts, request, params)
        rid, n = random_id("cmpl"), request.n
        jobs = []
        for p_index, prompt in enumerate(prompts):
            for j in range(n):
                job_id = f"{rid}-{p_index * n + j}"
                jobs.append(EngineJob(prompt.token_ids, choice_params(params, j), job_id))
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        # choice i belongs to prompt i // n
        choice_prompts = [prompts[i // n] for i in range(len(jobs))]
        if request.stream:
            return sse_response(self._stream(request, rid, jobs, choice_prompts, prompt_tokens))
        return await self._full(request, rid, jobs, choice_prompts, prompt_tokens)

    def _prompts(self, request: CompletionRequest, params: SamplingParams) -> list[_Prompt]:
        """A worker thread's part: every prompt's ids, each checked (check_request)."""
        return [self._prompt(p, request, params) for p in request.prompt]

    def _prompt(
        self, prompt: str | list[int], request: CompletionRequest, params: SamplingParams
    ) -> _Prompt:
        tokenizer, max_model_len = self.engine.tokenizer, self.engine.max_model_len
        vocab = self.engine.vocab_size
        if isinstance(prompt, str):
            ids = self.tokens.encode(prompt, request.add_special_tokens, max_model_len, "prompt")
            check_request(ids, params, max_model_len, vocab, param="prompt")
            return _Prompt(prompt, ids)
        # A client's ids: bounded by the model's vocabulary and the tokenizer's (echo
        # decodes them), checked before either reads them.
        check_request(prompt, params, max_model_len, min(len(tokenizer), vocab), param="prompt")
        text = tokenizer.decode(prompt) if request.echo else ""
        return _Prompt(text, list(prompt))

    async def _full(
        self,
        request: CompletionRequest,
        rid: str,
        jobs: list[EngineJob],
        prompts: list[_Prompt],
        prompt_tokens: int,
    ) -> Response:
        tallies = [ChoiceTally(drop_output=request.echo_only) for _ in jobs]
        async with aclosing(stream_deltas(self.engine, jobs)) as deltas:
            async for i, delta in deltas:
                if delta.error:
                    raise EngineDeadError(delta.error)
                tallies[i].add(delta)
        choices = []
        for i, (tally, prompt) in enumerate(zip(tallies, prompts)):
            text, logprobs = tally.text, None
            if request.logprobs is not None:
                ids, entries = self._prompt_part(request, prompt, tally)
                logprobs, _ = completion_logprobs(
                    self.texts, ids + tally.token_ids, entries + tally.logprobs, 0
                )
            if request.echo:
                text = prompt.text + text
            choices.append(
                CompletionChoice(
                    index=i,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=tally.finish_reason,
                    stop_reason=tally.stop_reason,
                )
            )
        response = CompletionResponse(
            id=rid,
            created=now(),
            model=self.engine.model_name,
            choices=choices,
            usage=usage_of(prompt_tokens, tallies),
        )
        return json_response(response)

    @staticmethod
    def _prompt_part(
        request: CompletionRequest, prompt: _Prompt, tally: ChoiceTally
    ) -> tuple[list[int], list[Logprob | None]]:
        """The echoed prompt's tokens and logprobs (the first token has none)."""
        if not request.echo:
            return [], []
        entries = tally.prompt_logprobs or [None] * len(prompt.token_ids)
        return list(prompt.token_ids), list(entries)

    async def _stream(
        self,
        request: CompletionRequest,
        rid: str,
        jobs: list[EngineJob],
        prompts: list[_Prompt],
        prompt_tokens: int,
    ) -> AsyncIterator[bytes]:
        tallies = [ChoiceTally(keep=False, drop_output=request.echo_only) for _ in jobs]
        created, model = now(), self.engine.model_name
        try:
            async with aclosing(stream_deltas(self.engine, jobs)) as deltas:
                async for i, delta in deltas:
                    if delta.error:
                        raise EngineDeadError(delta.error)
                    tally = tallies[i]
                    tally.add(delta)
                    choice = self._chunk_choice(request, i, delta, tally, prompts[i])
                    if choice is not None:
                        chunk = CompletionChunk(
                            id=rid, created=created, model=model, choices=[choice]
                        )
                        yield data_frame(chunk)
            if request.include_usage:
                usage = usage_of(prompt_tokens, tallies)
                yield data_frame(
                    CompletionChunk(id=rid, created=created, model=model, choices=[], usage=usage)
                )
        except Exception as exc:
            yield error_frame(exc)
        yield DONE_FRAME

    def _chunk_choice(
        self,
        request: CompletionRequest,
        i: int,
        delta: RequestDelta,
        tally: ChoiceTally,
        prompt: _Prompt,
    ) -> CompletionChoice | None:
        """This delta's part of choice i, or None when it adds nothing to send."""
        first = not tally.started
        text = "" if request.echo_only else delta.text
        ids, entries = [], []
        if first and request.echo:
            text = prompt.text + text
            ids, entries = self._prompt_part(request, prompt, tally)
        if not request.echo_only:
            ids, entries = ids + delta.token_ids, entries + list(delta.logprobs)
        logprobs = None
        if request.logprobs is not None and ids:
            logprobs, tally.text_offset = completion_logprobs(
                self.texts, ids, entries, tally.text_offset
            )
        if not (text or logprobs or delta.finished):
            return None
        tally.started = True
        return CompletionChoice(
            index=i,
            text=text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason if delta.finished else None,
            stop_reason=delta.stop_reason if delta.finished else None,
        )
