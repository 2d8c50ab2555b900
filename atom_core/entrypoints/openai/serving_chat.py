"""POST /v1/chat/completions: render the chat template, then run it as a completion.

The request plumbing (model check, context check, fan-in of n choices, aborting on a
dropped response, usage) is shared with /v1/completions and lives in serving_completion.
Tool calls and reasoning are not parsed here yet: ``tools`` reaches the template and the
model's reply comes back as content.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from atom_core.engine.sequence import Logprob
from atom_core.entrypoints.openai.client_api import EngineClientAPI
from atom_core.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatMessageOut,
    ChatTokenLogprob,
    TopLogprob,
    now,
    random_id,
)
from atom_core.entrypoints.openai.serving_completion import (
    ChoiceTally,
    EngineJob,
    TokenTexts,
    check_model,
    check_prompt_len,
    choice_params,
    error_frame,
    served_names,
    stream_deltas,
    usage_of,
)
from atom_core.entrypoints.openai.sse import DONE_FRAME, data_frame, json_response, sse_response
from atom_core.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)

# apply_chat_template's own arguments: a client's chat_template_kwargs may not set these
# (tokenize=True, say, would hand back ids where the handler expects text).
_RESERVED_KWARGS = frozenset(
    {
        "conversation", "messages", "chat_template", "tools", "documents", "tokenize",
        "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def chat_logprobs(
    texts: TokenTexts, token_ids: list[int], entries: list[Logprob], top_n: int
) -> ChatLogprobs:
    """OpenAI's chat shape. ``bytes`` is the UTF-8 of the token's text, so a token that
    is part of a multi-byte character shows U+FFFD's bytes, not its raw bytes."""

    def top(token_id: int, logprob: float) -> TopLogprob:
        token = texts(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    content = []
    for token_id, entry in zip(token_ids, entries):
        token = texts(token_id)
        alts = [top(t, lp) for t, lp in entry.top[:top_n]]
        content.append(
            ChatTokenLogprob(
                token=token, logprob=entry.logprob, bytes=list(token.encode()), top_logprobs=alts
            )
        )
    return ChatLogprobs(content=content)


def _arguments_as_object(call: Any) -> None:
    """OpenAI sends a past call's arguments as a JSON string; templates that write them
    with ``| tojson`` (Llama 3's) need the object, and those that accept either (Qwen's)
    take it too - so the string is parsed where it is a JSON object (vLLM does the same)."""
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return
        if isinstance(arguments, dict):
            function["arguments"] = arguments


class OpenAIServingChat:
    """``await OpenAIServingChat(engine).create(request, raw_request)``."""

    def __init__(self, engine: EngineClientAPI, model_aliases: Iterable[str] | None = None) -> None:
        self.engine = engine
        self.names = served_names(engine, model_aliases)
        self.texts = TokenTexts(engine.tokenizer)
        # OpenAI's "developer" role replaced "system"; a template that never mentions it
        # would drop such a message silently (Qwen's does), so it is sent as "system".
        template = engine.chat_template or getattr(engine.tokenizer, "chat_template", None)
        self._developer_role = "developer" if "developer" in str(template) else "system"

    async def create(
        self, request: ChatCompletionRequest, raw_request: Request | None = None
    ) -> Response:
        check_model(request.model, self.names)
        prompt_ids = self.render(request)
        check_prompt_len(self.engine, len(prompt_ids), "messages")
        params = request.to_sampling_params(self.engine.max_model_len - len(prompt_ids))
        rid = random_id("chatcmpl")
        jobs = [
            EngineJob(prompt_ids, choice_params(params, i), f"{rid}-{i}") for i in range(request.n)
        ]
        if request.stream:
            return sse_response(self._stream(request, rid, jobs, len(prompt_ids)))
        return await self._full(request, rid, jobs, len(prompt_ids))

    def render(self, request: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids: the chat template's text, tokenized without adding
        special tokens (the template already wrote them)."""
        tokenizer = self.engine.tokenizer
        messages = [self._message(m) for m in request.messages]
        extra = request.chat_template_kwargs or {}
        kwargs = {"add_generation_prompt": True}
        kwargs.update({k: v for k, v in extra.items() if k not in _RESERVED_KWARGS})
        try:
            text = tokenizer.apply_chat_template(
                messages,
                chat_template=self.engine.chat_template,
                tokenize=False,
                tools=request.tools,
                **kwargs,
            )
        except Exception as exc:
            # The template rendered at start-up; what it refuses now is these messages
            # (raise_exception("roles must alternate"), a missing key, ...).
            logger.info("chat template refused a request: %s", exc)
            raise InvalidRequestError(
                f"the chat template could not render these messages: {exc}", param="messages"
            ) from exc
        if not isinstance(text, str):
            raise InvalidRequestError("the chat template did not produce text", param="messages")
        return tokenizer.encode(text, add_special_tokens=False)

    def _message(self, message: ChatMessage) -> dict[str, Any]:
        out = message.model_dump(exclude_none=True)
        out["content"] = message.content or ""  # a template would print None as "None"
        if message.role == "developer":
            out["role"] = self._developer_role
        for call in out.get("tool_calls") or ():
            _arguments_as_object(call)
        return out

    async def _full(
        self, request: ChatCompletionRequest, rid: str, jobs: list[EngineJob], prompt_tokens: int
    ) -> Response:
        tallies = [ChoiceTally() for _ in jobs]
        async with aclosing(stream_deltas(self.engine, jobs)) as deltas:
            async for i, delta in deltas:
                if delta.error:
                    raise EngineDeadError(delta.error)
                tallies[i].add(delta)
        top_n = request.top_logprobs or 0
        choices = [
            ChatChoice(
                index=i,
                message=ChatMessageOut(content=tally.text),
                logprobs=chat_logprobs(self.texts, tally.token_ids, tally.logprobs, top_n)
                if request.logprobs
                else None,
                finish_reason=tally.finish_reason,
                stop_reason=tally.stop_reason,
            )
            for i, tally in enumerate(tallies)
        ]
        response = ChatCompletionResponse(
            id=rid,
            created=now(),
            model=self.engine.model_name,
            choices=choices,
            usage=usage_of(prompt_tokens, tallies),
        )
        return json_response(response)

    async def _stream(
        self, request: ChatCompletionRequest, rid: str, jobs: list[EngineJob], prompt_tokens: int
    ) -> AsyncIterator[bytes]:
        tallies = [ChoiceTally(keep=False) for _ in jobs]
        created, model = now(), self.engine.model_name
        top_n = request.top_logprobs or 0
        try:
            async with aclosing(stream_deltas(self.engine, jobs)) as deltas:
                async for i, delta in deltas:
                    if delta.error:
                        raise EngineDeadError(delta.error)
                    tally = tallies[i]
                    tally.add(delta)
                    logprobs = None
                    if request.logprobs and delta.token_ids:
                        logprobs = chat_logprobs(self.texts, delta.token_ids, delta.logprobs, top_n)
                    first = not tally.started
                    if not (first or delta.text or logprobs or delta.finished):
                        continue
                    tally.started = True
                    # The first chunk of a choice names the role; the last has no content
                    # of its own when the final delta brought none (OpenAI's `delta: {}`).
                    content = delta.text if (first or delta.text) else None
                    choice = ChatChunkChoice(
                        index=i,
                        delta=ChatDelta(role="assistant" if first else None, content=content),
                        logprobs=logprobs,
                        finish_reason=delta.finish_reason if delta.finished else None,
                        stop_reason=delta.stop_reason if delta.finished else None,
                    )
                    yield data_frame(
                        ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])
                    )
            if request.include_usage:
                usage = usage_of(prompt_tokens, tallies)
                yield data_frame(
                    ChatCompletionChunk(
                        id=rid, created=created, model=model, choices=[], usage=usage
                    )
                )
        except Exception as exc:
            yield error_frame(exc)
        yield DONE_FRAME
