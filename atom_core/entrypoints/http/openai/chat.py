"""POST /v1/chat/completions: render the chat template, run it as a completion, and read
the reply with the model's ResponseParser.

The request plumbing (model check, fan-in of n choices, aborting on a dropped response,
usage) is shared with /v1/completions and lives in http/generation.py; the rendered
prompt and the parameters pass the engine's check_request once.
Every reply goes through one ResponseReader per choice: streamed, it is fed each engine
delta; not streamed, it is fed the whole text once (``ResponseParser.read_whole``). There
is no second reader, so the two modes agree byte for byte on content, reasoning_content
and tool calls. /v1/messages (anthropic/messages.py) renders through the same ``render_prompt``
and answers its thinking switch through the same ``thinking``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

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
    ChatToolCall,
    ChatToolCallDelta,
    FunctionCall,
    FunctionDelta,
    TopLogprob,
    now,
    random_id,
)
from atom_core.entrypoints.http.prompt_tokens import PromptTokenizer, off_loop
from atom_core.entrypoints.http.sse import DONE_FRAME, data_frame, json_response, sse_response
from atom_core.errors import ConfigError, EngineDeadError, InvalidRequestError
from atom_core.generation_defaults import GenerationDefaults
from atom_core.parsing.call_grammar import forced_call_grammar
from atom_core.parsing.chat_encoders import (
    ChatEncoder,
    JinjaChatEncoder,
    PythonChatEncoder,
    load_chat_encoder,
)
from atom_core.parsing.events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallStart,
)
from atom_core.parsing.response import (
    ParsedResponse,
    ResponseParser,
    ResponseReader,
    special_tokens,
)
from atom_core.parsing.tool_policy import ToolPolicy
from atom_core.parsing.tool_stream import new_call_id
from atom_core.sampling_params import SamplingParams
from atom_core.structured import StructuredSpec

logger = logging.getLogger(__name__)

# apply_chat_template's own arguments: a client's chat_template_kwargs may not set these
# (tokenize=True, say, would hand back ids where the handler expects text).
_RESERVED_KWARGS = frozenset(
    {
        "conversation", "messages", "chat_template", "tools", "documents", "tokenize",
        "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs", "continue_final_message",
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


def chat_encoder_for(
    engine: EngineClientAPI, model_path: str | Path | None = None
) -> ChatEncoder | None:
    """What the start-up probes read and what a model-side encoder renders with: the
    model's own ``<model>/encoding/encoding_*.py`` when it ships one, else the Jinja
    template the handler renders (the GGUF's or the tokenizer's); None without either."""
    if model_path is not None and any((Path(model_path) / "encoding").glob("encoding_*.py")):
        return load_chat_encoder(model_path)
    template = engine.chat_template or getattr(engine.tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(engine.tokenizer, key, None)
        if isinstance(value, str):
            special[key] = value
    try:
        return JinjaChatEncoder(template, special)
    except ConfigError as exc:  # transformers may still render it; only detection is lost
        logger.warning("chat template not readable for tool-format detection: %s", exc)
        return None


def resolve_chat_parser(
    engine: EngineClientAPI,
    model_path: str | Path | None,
    tool_call_parser: str = "auto",
    reasoning_parser: str = "auto",
) -> tuple[ResponseParser, ChatEncoder | None]:
    """Start-up: the model's ResponseParser (tool-call format, reasoning dialect, thinking
    switch; logged) read from its chat encoder, and that encoder."""
    encoder = chat_encoder_for(engine, model_path)
    return ResponseParser.resolve(encoder, tool_call_parser, reasoning_parser), encoder


def effective_tool_choice(
    tools: Sequence[Any] | None, tool_choice: str | Mapping[str, Any] | None
) -> str | Mapping[str, Any] | None:
    """A request that declares no tools reads as tool_choice "none": its markup is still
    read (a format's framing must not leak) but nothing is dispatched. Requiring a call
    without declaring any tool is refused."""
    if tools:
        return tool_choice
    if ToolPolicy.from_request(None, tool_choice).choice in ("required", "named"):
        raise InvalidRequestError("tool_choice requires a call but the request declares no tools",
                                  param="tool_choice")
    return "none"


class ChatPrompt(Protocol):
    """What ``OpenAIServingChat.render`` reads of a request: a chat completion's, or the
    chat form of /tokenize (which must count the same prompt)."""

    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None
    chat_template_kwargs: dict[str, Any] | None
    add_generation_prompt: bool
    continue_final_message: bool

    @property
    def thinking_requested(self) -> bool | None: ...


def prompt_ending(request: ChatPrompt) -> dict[str, bool]:
    """The template kwargs that end the prompt (vLLM's request fields): the generation
    prompt, an assistant turn opened for the reply (``add_generation_prompt``, default
    true), or the final assistant message left open for the model to continue
    (``continue_final_message``: a prefilled reply). Asking for both, as vLLM refuses it,
    or continuing a message that is not the assistant's, is a 400."""
    if not request.continue_final_message:
        return {"add_generation_prompt": request.add_generation_prompt}
    if request.add_generation_prompt:
        raise InvalidRequestError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True "
            "(`add_generation_prompt` defaults to true: send it as false)",
            param="continue_final_message",
        )
    role = request.messages[-1].role
    if role != "assistant":
        raise InvalidRequestError(
            f"`continue_final_message` continues the final message, which must be the "
            f"assistant's; it is {role!r}",
            param="continue_final_message",
        )
    return {"add_generation_prompt": False, "continue_final_message": True}


@dataclass(frozen=True)
class ReplyReading:
    """How one request's replies are read: ``ResponseParser.reader``'s arguments, and
    whether reasoning reaches the client. ``build`` checks tools and tool_choice, so a bad
    one is a 400 before any frame goes out."""

    parser: ResponseParser
    prompt: str
    tools: Sequence[Any] | None
    tool_choice: str | Mapping[str, Any] | None
    show_reasoning: bool = True
    make_id: Callable[[], str] = new_call_id
    parallel_tool_calls: bool = True

    @classmethod
    def build(cls, parser: ResponseParser, prompt: str, tools: Sequence[Any] | None,
              tool_choice: str | Mapping[str, Any] | None, **kw: Any) -> ReplyReading:
        choice = effective_tool_choice(tools, tool_choice)
        ToolPolicy.from_request(tools, choice)  # raises InvalidRequestError
        return cls(parser, prompt, tools, choice, **kw)

    def reader(self) -> ResponseReader:
        """Streaming: one per choice."""
        return self.parser.reader(
            prompt=self.prompt, tools=self.tools, tool_choice=self.tool_choice,
            make_id=self.make_id, parallel_tool_calls=self.parallel_tool_calls,
        )

    def whole(self, text: str, finish_reason: str) -> ParsedResponse:
        """Not streaming: the same reader fed the whole text once."""
        return self.parser.read_whole(text, finish_reason, prompt=self.prompt, tools=self.tools,
                                      tool_choice=self.tool_choice, make_id=self.make_id,
                                      parallel_tool_calls=self.parallel_tool_calls)


def _delta_of(event: Event) -> ChatDelta:
    """One reader event as a chat delta (the caller drops reasoning it withholds)."""
    if isinstance(event, ContentDelta):
        return ChatDelta(content=event.text)
    if isinstance(event, ReasoningDelta):
        return ChatDelta(reasoning_content=event.text)
    if isinstance(event, ToolCallStart):
        function = FunctionDelta(name=event.name, arguments="")
        call = ChatToolCallDelta(index=event.index, id=event.id, type="function", function=function)
        return ChatDelta(tool_calls=[call])
    assert isinstance(event, ToolCallArguments)
    call = ChatToolCallDelta(index=event.index, function=FunctionDelta(arguments=event.arguments))
    return ChatDelta(tool_calls=[call])


class OpenAIServingChat:
    """``await OpenAIServingChat(engine).create(request, raw_request)``.

    ``parser`` is the model's ResponseParser, resolved once at start-up (http/app.py);
    without one it is resolved here from the engine's chat template with ``auto``.
    ``encoder`` is the ChatEncoder it was resolved from: a model-side Python encoder also
    renders the prompts (transformers cannot), a Jinja one is only read. ``defaults`` fill
    the sampling fields a request leaves out (``--generation-config``)."""

    def __init__(
        self,
        engine: EngineClientAPI,
        model_aliases: Iterable[str] | None = None,
        *,
        parser: ResponseParser | None = None,
        encoder: ChatEncoder | None = None,
        defaults: GenerationDefaults | None = None,
    ) -> None:
        self.engine = engine
        self.defaults = defaults or GenerationDefaults()
        self.names = served_names(engine, model_aliases)
        self.texts = TokenTexts(engine.tokenizer)
        self.tokens = PromptTokenizer(engine.tokenizer)
        if parser is None:
            encoder = encoder or chat_encoder_for(engine)
            parser = ResponseParser.resolve(encoder)
        self.parser = parser
        self.encoder = encoder
        special = parser.special_markers(engine.tokenizer)
        if special:
            logger.info("the reply's markers %s are special tokens: chat replies are decoded "
                        "with special tokens kept", ", ".join(special))
        self.keep_special_tokens = bool(special)
        self.special_tokens = frozenset(special_tokens(engine.tokenizer))
        # OpenAI's "developer" role replaced "system"; a template that never mentions it
        # would drop such a message silently (Qwen's does), so it is sent as "system".
        template = engine.chat_template or getattr(engine.tokenizer, "chat_template", None)
        if isinstance(encoder, PythonChatEncoder):
            template = encoder.source
        self._developer_role = "developer" if "developer" in str(template) else "system"

    async def create(
        self, request: ChatCompletionRequest, raw_request: Request | None = None
    ) -> Response:
        check_model(request.model, self.names)
        prompt, prompt_ids, show_reasoning = await self.render(request)
        # max_tokens null: as many as fit, which the engine's context cap enforces.
        params = self.reply_params(self.defaults.apply(
            request.to_sampling_params(self.engine.max_model_len), request.model_fields_set))
        reading = ReplyReading.build(self.parser, prompt, request.tools, request.tool_choice,
                                     show_reasoning=show_reasoning,
                                     parallel_tool_calls=request.parallel_tool_calls)
        params = self.forced_call(params, reading)
        check_request(prompt_ids, params, self.engine.max_model_len, self.engine.vocab_size,
                      param="messages")
        check_constraint(self.engine, params)
        rid = random_id("chatcmpl")
        jobs = [
            EngineJob(prompt_ids, choice_params(params, i), f"{rid}-{i}") for i in range(request.n)
        ]
        if request.stream:
            return sse_response(self._stream(request, rid, jobs, len(prompt_ids), reading))
        return await self._full(request, rid, jobs, len(prompt_ids), reading)

    def thinking(self, enabled: bool | None) -> tuple[dict[str, Any], bool]:
        """The template kwargs answering a client's thinking switch, and whether reasoning
        reaches the client. It is answered in the prompt, through the switch resolved at
        start-up. A template with no switch cannot prevent reasoning, so "off" is answered
        the only way left: still separated, then withheld. None (not asked) leaves the
        model's default alone at both layers."""
        if enabled is None:
            return {}, True
        switch = self.parser.thinking_switch
        if switch is None:
            return {}, enabled
        return switch.kwargs(enabled), True

    def forced_call(self, params: SamplingParams, reading: ReplyReading) -> SamplingParams:
        """``params`` constrained to a call in the model's tool format when the request's
        tool_choice forces one ("required", Anthropic's "any", a named function); a 400
        when the format cannot write that grammar, or beside another output constraint."""
        grammar = forced_call_grammar(
            self.parser.tool_format, self.parser.dialect, reading.prompt, reading.tools,
            reading.tool_choice, reading.parallel_tool_calls, self.special_tokens)
        if grammar is None:
            return params
        if params.structured is not None:
            other = params.structured.param
            raise InvalidRequestError(
                f"{other}: a request takes one output constraint, and tool_choice forces a "
                "tool call", param=other)
        spec = StructuredSpec("grammar", grammar, "tool_choice")
        spec.validate()
        return replace(params, structured=spec)

    def reply_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` as a chat reply decodes: with the special tokens the reader needs."""
        if self.keep_special_tokens and params.skip_special_tokens:
            return replace(params, skip_special_tokens=False)
        return params

    async def render(
        self, request: ChatPrompt, max_len: int | None = None
    ) -> tuple[str, list[int], bool]:
        """The prompt's text and token ids, and whether reasoning reaches the client.
        A client's own chat_template_kwargs win over the thinking knobs. A prompt of
        ``max_len`` tokens is refused (default: the context; /tokenize counts past it)."""
        thinking_kwargs, show_reasoning = self.thinking(request.thinking_requested)
        kwargs: dict[str, Any] = {**prompt_ending(request), **thinking_kwargs}
        extra = request.chat_template_kwargs or {}
        kwargs.update({k: v for k, v in extra.items() if k not in _RESERVED_KWARGS})
        text, ids = await off_loop(self._render_request, request, kwargs, max_len)
        return text, ids, show_reasoning

    def _render_request(
        self, request: ChatPrompt, kwargs: dict[str, Any], max_len: int | None
    ) -> tuple[str, list[int]]:
        messages = [self._message(m) for m in request.messages]  # O(body): off the loop too
        return self._render_prompt(messages, request.tools, kwargs, max_len)

    async def render_prompt(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, kwargs: dict[str, Any],
        max_len: int | None = None,
    ) -> tuple[str, list[int]]:
        """The chat template's text and its ids, tokenized without adding special tokens
        (the template already wrote them); rendered and tokenized on a worker thread."""
        return await off_loop(self._render_prompt, messages, tools, kwargs, max_len)

    def _render_prompt(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, kwargs: dict[str, Any],
        max_len: int | None = None,
    ) -> tuple[str, list[int]]:
        tokenizer, max_model_len = self.engine.tokenizer, max_len or self.engine.max_model_len
        # The users' own text counts toward the context, as OpenAI counts it: a template
        # writes every user turn (trimmed at most), so text that alone is beyond the
        # context is refused before it is rendered. Rendering copies it several times,
        # holding the GIL (~20 ms a copy of 30 MB on a 2-core VM): the event loop waits.
        user_text = [m["content"] for m in messages
                     if m.get("role") == "user" and isinstance(m.get("content"), str)]
        self.tokens.refuse_beyond(user_text, max_model_len, "messages", trimmed=True)
        try:
            if isinstance(self.encoder, PythonChatEncoder):
                text = self.encoder.render(messages, tools=tools, **kwargs)
            else:
                text = tokenizer.apply_chat_template(
                    messages, chat_template=self.engine.chat_template, tokenize=False,
                    tools=tools, **kwargs,
                )
        except InvalidRequestError:  # the encoder's own (render_continuing's)
            raise
        except Exception as exc:
            # The template rendered at start-up; what it refuses now is these messages
            # (raise_exception("roles must alternate"), a missing key, ...).
            logger.info("chat template refused a request: %s", exc)
            raise InvalidRequestError(
                f"the chat template could not render these messages: {exc}", param="messages"
            ) from exc
        if not isinstance(text, str):
            raise InvalidRequestError("the chat template did not produce text", param="messages")
        return text, self.tokens.encode(text, False, max_model_len, "messages")

    def _message(self, message: ChatMessage) -> dict[str, Any]:
        out = message.model_dump(exclude_none=True)
        out["content"] = message.content or ""  # a template would print None as "None"
        if message.role == "developer":
            out["role"] = self._developer_role
        for call in out.get("tool_calls") or ():
            _arguments_as_object(call)
        return out

    async def _full(
        self,
        request: ChatCompletionRequest,
        rid: str,
        jobs: list[EngineJob],
        prompt_tokens: int,
        reading: ReplyReading,
    ) -> Response:
        tallies = [ChoiceTally() for _ in jobs]
        async with aclosing(stream_deltas(self.engine, jobs)) as deltas:
            async for i, delta in deltas:
                if delta.error:
                    raise EngineDeadError(delta.error)
                tallies[i].add(delta)
        top_n = request.top_logprobs or 0
        choices = []
        for i, tally in enumerate(tallies):
            parsed = reading.whole(tally.text, tally.finish_reason or "stop")
            calls = [
                ChatToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in parsed.tool_calls
            ]
            message = ChatMessageOut(
                # OpenAI's shape: a reply that only calls tools has content null.
                content=parsed.content if parsed.content or not calls else None,
                reasoning_content=(
                    (parsed.reasoning_content or None) if reading.show_reasoning else None
                ),
                tool_calls=calls or None,
            )
            logprobs = None
            if request.logprobs:
                logprobs = chat_logprobs(self.texts, tally.token_ids, tally.logprobs, top_n)
            choices.append(
                ChatChoice(
                    index=i, message=message, logprobs=logprobs,
                    finish_reason=parsed.finish_reason, stop_reason=tally.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=rid,
            created=now(),
            model=self.engine.model_name,
            choices=choices,
            usage=usage_of(prompt_tokens, tallies),
        )
        return json_response(response)

    async def _stream(
        self,
        request: ChatCompletionRequest,
        rid: str,
        jobs: list[EngineJob],
        prompt_tokens: int,
        reading: ReplyReading,
    ) -> AsyncIterator[bytes]:
        tallies = [ChoiceTally(keep=False) for _ in jobs]
        readers = [reading.reader() for _ in jobs]
        created, model = now(), self.engine.model_name
        top_n = request.top_logprobs or 0

        def frame(choice: ChatChunkChoice) -> bytes:
            chunk = ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])
            return data_frame(chunk)

        try:
            async with aclosing(stream_deltas(self.engine, jobs)) as deltas:
                async for i, delta in deltas:
                    if delta.error:
                        raise EngineDeadError(delta.error)
                    tally, reader = tallies[i], readers[i]
                    tally.add(delta)
                    out: list[ChatChunkChoice] = []
                    if not tally.started:  # the first frame names the role, as OpenAI's does
                        tally.started = True
                        role = ChatDelta(role="assistant", content="")
                        out.append(ChatChunkChoice(index=i, delta=role))
                    events = reader.feed(delta.text)
                    if delta.finished:
                        events += reader.finish(delta.finish_reason or "stop")
                    for event in events:
                        if reading.show_reasoning or not isinstance(event, ReasoningDelta):
                            out.append(ChatChunkChoice(index=i, delta=_delta_of(event)))
                    if request.logprobs and delta.token_ids:
                        # A token's logprob goes out when it arrives, even while the
                        # reader holds its text (so it rides on the frame it can).
                        logprobs = chat_logprobs(self.texts, delta.token_ids, delta.logprobs, top_n)
                        if not out:
                            out.append(ChatChunkChoice(index=i, delta=ChatDelta()))
                        out[-1].logprobs = logprobs
                    if delta.finished:
                        out.append(ChatChunkChoice(
                            index=i, delta=ChatDelta(), finish_reason=reader.result().finish_reason,
                            stop_reason=delta.stop_reason,
                        ))
                    if out:  # one write per engine delta, however many frames it makes
                        yield b"".join(frame(c) for c in out)
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
