"""POST /v1/messages: Anthropic's Messages API, over the chat handler's renderer and reader;
and /v1/messages/count_tokens, which counts the prompt /v1/messages would send.

A request becomes chat-template messages (system, text, tool_use as past tool_calls,
tool_result as tool turns, thinking as the turn's reasoning_content), is rendered by
``OpenAIServingChat.render_prompt`` and read by the same ResponseReader as
/v1/chat/completions. ``MessageBlocks`` turns the reader's events into Anthropic's
content-block events; the non-streamed message is those same events folded, so the two
modes agree by construction.

Two rules of the serving guide shape the blocks:

- A tool_use block opens on ToolCallArguments, not on ToolCallStart: its
  ``content_block_start`` carries ``"input": {}``, which on its own is a complete
  zero-argument call, and there is no frame for "the name is known, the arguments are
  coming". So the name waits for the arguments here (it does not on chat completions).
- ``thinking`` is answered in the prompt, through the template's switch resolved at
  start-up. When the template has none, a disabled request's reasoning is still separated
  (the tool parser must not read it) and its thinking blocks are withheld; a reply that was
  nothing but reasoning then ends on an empty text block.

Errors leave in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``,
with the statuses the OpenAI endpoints use; so the body is parsed here, not by FastAPI.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import msgspec
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from atom_core.engine.request_stream import RequestDelta
from atom_core.engine.validation import check_request
from atom_core.entrypoints.http.anthropic.protocol import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ContentOut,
    CountTokensRequest,
    InputJsonDelta,
    MessageDelta,
    MessageOut,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessageTokensCount,
    OutputUsage,
    StopInfo,
    StreamEvent,
    TextBlock,
    TextDelta,
    TextOut,
    ThinkingBlock,
    ThinkingDelta,
    ThinkingOut,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    Usage,
    error_out,
    event_name,
    message_id,
    tool_use_id,
)
from atom_core.entrypoints.http.errors import exception_body, validation_body
from atom_core.entrypoints.http.generation import (
    ChoiceTally,
    EngineJob,
    check_constraint,
    check_model,
    stream_deltas,
)
from atom_core.entrypoints.http.openai.chat import OpenAIServingChat, ReplyReading
from atom_core.entrypoints.http.sse import event_frame, json_response, sse_response
from atom_core.errors import AtomError, EngineDeadError
from atom_core.parsing.events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallStart,
)
from atom_core.parsing.response import ResponseReader
from atom_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_EMPTY_INPUT = msgspec.Raw(b"{}")
Req = TypeVar("Req", bound=CountTokensRequest)


# ------------------------------------------------------------------------------ errors


def anthropic_error_response(exc: BaseException) -> Response:
    """``exc`` as Anthropic's error body, with the status the OpenAI endpoints give it."""
    status, body = exception_body(exc)
    if status >= 500 and not isinstance(exc, AtomError):
        logger.error("POST /v1/messages failed", exc_info=exc)
    return json_response(error_out(body.error.message, status), status)


def _error_event(exc: Exception) -> bytes:
    """A stream's last word when it fails after the headers went out."""
    if not isinstance(exc, AtomError):
        logger.error("messages stream failed", exc_info=exc)
    status, body = exception_body(exc)
    return event_frame("error", error_out(body.error.message, status))


# ------------------------------------------------------------------- request mapping


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The request's turns as chat-template messages (OpenAI's shape, which templates read)."""
    out: list[dict[str, Any]] = []
    system = request.system_text
    if system:
        out.append({"role": "system", "content": system})
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool turns that answer it
    for message in request.messages:
        # Which blocks each role may carry is checked by the request model.
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            out.extend(_user_turns(message.content, names))
        else:
            out.append(_assistant_turn(message.content, names))
    return out


def _user_turns(blocks: list[Any], names: dict[str, str]) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            turn = {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text}
            if block.tool_use_id in names:
                turn["name"] = names[block.tool_use_id]
            turns.append(turn)
        else:
            texts.append(block.text)
    if texts:
        turns.append({"role": "user", "content": "\n".join(texts)})
    return turns


def _assistant_turn(blocks: list[Any], names: dict[str, str]) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            names[block.id] = block.name
            # Arguments as an object: templates that write them with tojson need one.
            function = {"name": block.name, "arguments": block.input}
            calls.append({"id": block.id, "type": "function", "function": function})
        # A redacted_thinking block has nothing readable to replay.
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        turn["reasoning_content"] = "".join(reasoning)
    if calls:
        turn["tool_calls"] = calls
    return turn


def chat_tools(request: CountTokensRequest) -> list[dict[str, Any]] | None:
    if not request.tools:
        return None
    tools = []
    for tool in request.tools:
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    return tools


def stop_reason(finish_reason: str | None, stop: int | str | None, stop_sequences: list[str] | None,
                called: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for an engine finish."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str) and stop_sequences and stop in stop_sequences:
        return "stop_sequence", stop
    return "end_turn", None


# ---------------------------------------------------------------------------- blocks


class MessageBlocks:
    """Reader events -> Anthropic content-block stream events, for one message.

    ``fold`` applies those events to a content list: the non-streamed message is built by
    folding, so it is exactly what a client accumulating the stream ends up with."""

    def __init__(self, show_thinking: bool = True) -> None:
        self.show_thinking = show_thinking
        self.count = 0  # blocks opened so far; the open one, if any, is count - 1
        self.called = False
        self._open: type | None = None  # TextOut or ThinkingOut while one is open
        self._named: dict[int, tuple[str, str]] = {}  # call index -> (id, name), announced

    def feed(self, events: list[Event]) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        for event in events:
            if isinstance(event, ContentDelta):
                self._ensure(TextOut, out)
                delta = TextDelta(text=event.text)
                out.append(ContentBlockDelta(index=self.count - 1, delta=delta))
            elif isinstance(event, ReasoningDelta):
                if self.show_thinking:
                    self._ensure(ThinkingOut, out)
                    delta = ThinkingDelta(thinking=event.text)
                    out.append(ContentBlockDelta(index=self.count - 1, delta=delta))
            elif isinstance(event, ToolCallStart):
                # Remembered, not sent: the block opens when its input is complete.
                self._named[event.index] = (event.id, event.name)
            elif isinstance(event, ToolCallArguments):
                self._close(out)
                call_id, name = self._named.pop(event.index, (tool_use_id(), ""))
                index = self._start(ToolUseOut(id=call_id, name=name, input=_EMPTY_INPUT), out)
                arguments = InputJsonDelta(partial_json=event.arguments)
                out.append(ContentBlockDelta(index=index, delta=arguments))
                out.append(ContentBlockStop(index=index))
                self.called = True
        return out

    def finish(self) -> list[StreamEvent]:
        """Close the open block; a message with no block at all ends on an empty text one."""
        out: list[StreamEvent] = []
        self._close(out)
        if self.count == 0:
            out.append(ContentBlockStop(index=self._start(TextOut(text=""), out)))
        return out

    def _ensure(self, kind: type, out: list[StreamEvent]) -> None:
        if self._open is kind:
            return
        self._close(out)
        self._start(TextOut(text="") if kind is TextOut else ThinkingOut(thinking=""), out)
        self._open = kind

    def _start(self, block: ContentOut, out: list[StreamEvent]) -> int:
        out.append(ContentBlockStart(index=self.count, content_block=block))
        self.count += 1
        return self.count - 1

    def _close(self, out: list[StreamEvent]) -> None:
        if self._open is not None:
            out.append(ContentBlockStop(index=self.count - 1))
            self._open = None

    @staticmethod
    def fold(content: list[ContentOut], events: list[StreamEvent]) -> None:
        """Apply stream events to ``content``, as a client accumulating the stream does."""
        for event in events:
            if isinstance(event, ContentBlockStart):
                block = event.content_block
                content.append(msgspec.structs.replace(block))
            elif isinstance(event, ContentBlockDelta):
                block, delta = content[event.index], event.delta
                if isinstance(delta, TextDelta):
                    block.text += delta.text
                elif isinstance(delta, ThinkingDelta):
                    block.thinking += delta.thinking
                else:
                    block.input = msgspec.Raw(delta.partial_json.encode())


# --------------------------------------------------------------------------- handler


class AnthropicServingMessages:
    """``await AnthropicServingMessages(chat).handle(raw_request)``; ``chat`` supplies the
    engine, the served names, the renderer and the model's ResponseParser."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.engine = chat.engine

    async def handle(self, raw_request: Request) -> Response:
        """Parse the body and serve it; every error in Anthropic's shape."""
        return await self._serve(raw_request, MessagesRequest, self.create)

    async def handle_count_tokens(self, raw_request: Request) -> Response:
        """POST /v1/messages/count_tokens, errors in Anthropic's shape."""
        return await self._serve(raw_request, CountTokensRequest, self.count_tokens)

    @staticmethod
    async def _serve(raw_request: Request, model: type[Req],
                     create: Callable[[Req], Awaitable[Response]]) -> Response:
        try:
            request = model.model_validate_json(await raw_request.body())
        except ValidationError as exc:
            return json_response(error_out(validation_body(exc.errors()).error.message, 400), 400)
        try:
            return await create(request)
        except Exception as exc:
            return anthropic_error_response(exc)

    async def prompt(
        self, request: CountTokensRequest, max_len: int | None = None
    ) -> tuple[str, list[int], list[dict[str, Any]] | None, bool]:
        """The prompt's text and ids, the tools in OpenAI's shape, and whether thinking
        reaches the client. A prompt of ``max_len`` tokens is refused (default: the
        context)."""
        check_model(request.model, self.chat.names)
        enabled = None if request.thinking is None else request.thinking.type == "enabled"
        kwargs, show_thinking = self.chat.thinking(enabled)
        tools = chat_tools(request)
        prompt, prompt_ids = await self.chat.render_prompt(
            chat_messages(request), tools, {"add_generation_prompt": True, **kwargs}, max_len
        )
        return prompt, prompt_ids, tools, show_thinking

    async def count_tokens(self, request: CountTokensRequest) -> Response:
        """The tokens of the prompt ``create`` would send, counted past the context too
        (a client counts to learn whether its prompt fits)."""
        _, prompt_ids, _, _ = await self.prompt(request, max_len=sys.maxsize)
        return json_response(MessageTokensCount(input_tokens=len(prompt_ids)))

    async def create(self, request: MessagesRequest) -> Response:
        prompt, prompt_ids, tools, show_thinking = await self.prompt(request)
        params = self.chat.reply_params(self.chat.defaults.apply(SamplingParams(
            temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            max_tokens=request.max_tokens, stop_strings=request.stop_sequences or None,
        ), request.model_fields_set))
        tool_choice, parallel = None, True
        if request.tool_choice is not None:
            tool_choice = request.tool_choice.model_dump(
                include={"type", "name"}, exclude_none=True
            )
            parallel = not request.tool_choice.disable_parallel_tool_use
        reading = ReplyReading.build(
            self.chat.parser, prompt, tools, tool_choice, show_reasoning=show_thinking,
            make_id=tool_use_id, parallel_tool_calls=parallel,
        )
        params = self.chat.forced_call(params, reading)
        check_request(prompt_ids, params, self.engine.max_model_len, self.engine.vocab_size,
                      param="messages")
        check_constraint(self.engine, params)
        job = EngineJob(prompt_ids, params, message_id())
        if request.stream:
            return sse_response(self._stream(request, job, reading))
        return await self._full(request, job, reading)

    def _message(self, request: MessagesRequest, job: EngineJob, content: list[ContentOut],
                 tally: ChoiceTally | None = None, called: bool = False) -> MessageOut:
        """The message; without ``tally`` it is message_start's (nothing generated yet)."""
        usage = Usage(input_tokens=len(job.prompt_token_ids),
                      output_tokens=tally.num_output_tokens if tally else 0)
        reason, sequence = (None, None)
        if tally is not None:
            reason, sequence = stop_reason(tally.finish_reason, tally.stop_reason,
                                           request.stop_sequences, called)
        return MessageOut(id=job.request_id, model=self.engine.model_name, content=content,
                          stop_reason=reason, stop_sequence=sequence, usage=usage)

    async def _full(
        self, request: MessagesRequest, job: EngineJob, reading: ReplyReading
    ) -> Response:
        tally = ChoiceTally()
        async with aclosing(stream_deltas(self.engine, [job])) as deltas:
            async for _, delta in deltas:
                if delta.error:
                    raise EngineDeadError(delta.error)
                tally.add(delta)
        # The stream's reader fed the whole text once, and its events folded.
        reader, blocks = reading.reader(), MessageBlocks(reading.show_reasoning)
        events = reader.feed(tally.text) + reader.finish(tally.finish_reason or "stop")
        content: list[ContentOut] = []
        MessageBlocks.fold(content, blocks.feed(events) + blocks.finish())
        return json_response(self._message(request, job, content, tally, blocks.called))

    async def _stream(
        self, request: MessagesRequest, job: EngineJob, reading: ReplyReading
    ) -> AsyncIterator[bytes]:
        tally = ChoiceTally(keep=False)
        reader, blocks = reading.reader(), MessageBlocks(reading.show_reasoning)
        try:
            async with aclosing(stream_deltas(self.engine, [job])) as deltas:
                async for _, delta in deltas:
                    if delta.error:
                        raise EngineDeadError(delta.error)
                    tally.add(delta)
                    frames = self._frames(request, job, tally, reader, blocks, delta)
                    if frames:  # one write per engine delta, however many events it makes
                        yield frames
        except Exception as exc:
            yield _error_event(exc)

    def _frames(self, request: MessagesRequest, job: EngineJob, tally: ChoiceTally,
                reader: ResponseReader, blocks: MessageBlocks, delta: RequestDelta) -> bytes:
        out: list[StreamEvent] = []
        if not tally.started:
            # Sent with the first engine delta, not before: the wait for it is admission
            # and prefill, which the silence gauge must not count.
            tally.started = True
            out.append(MessageStart(message=self._message(request, job, [])))
        events = reader.feed(delta.text)
        if delta.finished:
            events += reader.finish(delta.finish_reason or "stop")
        out += blocks.feed(events)
        if delta.finished:
            out += blocks.finish()
            reason, sequence = stop_reason(tally.finish_reason, tally.stop_reason,
                                           request.stop_sequences, blocks.called)
            out.append(MessageDelta(delta=StopInfo(stop_reason=reason, stop_sequence=sequence),
                                    usage=OutputUsage(output_tokens=tally.num_output_tokens)))
            out.append(MessageStop())
        return b"".join(event_frame(event_name(e), e) for e in out)
