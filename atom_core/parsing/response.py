"""What a server drives: ResponseParser per model, ResponseReader per request.

    parser = ResponseParser.resolve(encoder, tool_call_parser="auto")   # once, at start-up
    reader = parser.reader(prompt=prompt, tools=req.tools, tool_choice=req.tool_choice)
    for delta in engine_text_deltas:
        for event in reader.feed(delta): ...          # ContentDelta, ReasoningDelta,
    for event in reader.finish(engine_finish_reason): ...  # ToolCallStart, ToolCallArguments
    reader.result()                                    # the whole message, for stream=false

The text goes through the reasoning stage first and only its content reaches the tool
stage, so a chain of thought is never read for tool calls. stream=false is
``parser.read_whole(text, ...)``: the same reader fed once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from atom_core.parsing.chat_encoders import (
    ChatEncoder,
    ThinkingSwitch,
    chat_template_source,
    render_probe_prompt,
    resolve_thinking_switch,
)
from atom_core.parsing.events import (
    ContentDelta,
    DispatchedCall,
    Event,
    ReasoningDelta,
    merge_deltas,
)
from atom_core.parsing.reasoning import ReasoningChannel
from atom_core.parsing.reasoning_dialects import (
    ReasoningDialect,
    resolve_dialect,
    with_fallback,
)
from atom_core.parsing.tool_detection import (
    check_tool_call_parser,
    resolve_tool_format,
)
from atom_core.parsing.tool_format import ToolFormat
from atom_core.parsing.tool_policy import ToolPolicy
from atom_core.parsing.tool_stream import ToolCallStream, new_call_id

logger = logging.getLogger(__name__)


def check_parser_names(tool_call_parser: str, reasoning_parser: str) -> None:
    """Refuse an unknown --tool-call-parser / --reasoning-parser (ConfigError): called
    before the engine process starts, so a typo costs no weight loading."""
    check_tool_call_parser(tool_call_parser)
    resolve_dialect(None, reasoning_parser)


@dataclass
class ParsedResponse:
    """A whole response as a message: what stream=false returns."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[DispatchedCall] = field(default_factory=list)
    finish_reason: str | None = None
    required_unmet: bool = False  # tool_choice "required" and nothing was dispatched

    def as_dict(self) -> dict[str, Any]:
        return {
            "content": self.content,
            "reasoning_content": self.reasoning_content,
            "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in self.tool_calls],
            "finish_reason": self.finish_reason,
        }


class ResponseReader:
    """One request's reader: text deltas in, events out; ``finish()`` at end of stream."""

    def __init__(
        self,
        channel: ReasoningChannel,
        tool_format: ToolFormat | None,
        policy: ToolPolicy,
        make_id: Callable[[], str] = new_call_id,
    ) -> None:
        self.channel = channel
        self.policy = policy
        self.reasoning = channel.splitter()
        self.tools = ToolCallStream(tool_format, policy, make_id)
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._finish_reason: str | None = None

    def feed(self, delta: str) -> list[Event]:
        return self._route(self.reasoning.feed(delta), at_end=False)

    def finish(self, finish_reason: str = "stop") -> list[Event]:
        """Flush everything held. ``finish_reason`` is the engine's (``stop``, ``length``);
        it becomes ``tool_calls`` when a call was dispatched."""
        events = self._route(self.reasoning.finish(), at_end=True)
        self._finish_reason = "tool_calls" if self.tools.calls else finish_reason
        return events

    def result(self) -> ParsedResponse:
        return ParsedResponse(
            "".join(self._content),
            "".join(self._reasoning),
            list(self.tools.calls),
            self._finish_reason,
            self.policy.choice == "required" and self._finish_reason is not None
            and not self.tools.calls,
        )

    def _route(self, events: list[Event], at_end: bool) -> list[Event]:
        out: list[Event] = []
        for ev in events:
            if isinstance(ev, ContentDelta):
                out.extend(self.tools.feed(ev.text))
            else:
                out.append(ev)
        if at_end:
            out.extend(self.tools.finish())
        out = merge_deltas(out)
        for ev in out:
            if isinstance(ev, ContentDelta):
                self._content.append(ev.text)
            elif isinstance(ev, ReasoningDelta):
                self._reasoning.append(ev.text)
        return out


class ResponseParser:
    """A model's output protocol, resolved once: its tool-call format and reasoning dialect."""

    def __init__(
        self,
        tool_format: ToolFormat | None = None,
        dialect: ReasoningDialect | None = None,
        description: str = "",
        thinking_switch: ThinkingSwitch | None = None,
    ) -> None:
        self.tool_format = tool_format
        self.dialect = dialect
        self.description = description
        self.thinking_switch = thinking_switch

    @classmethod
    def resolve(
        cls,
        encoder: ChatEncoder | None,
        tool_call_parser: str = "auto",
        reasoning_dialect: str = "auto",
        registries=None,
    ) -> ResponseParser:
        """Start-up: the format and dialect (``auto``: read from the chat template), the
        thinking switch, and one log line that says what was chosen and why."""
        fmt_reg = registries.tool_formats if registries else None
        dia_reg = registries.reasoning_dialects if registries else None
        # An unknown name fails before any rendering.
        check_tool_call_parser(tool_call_parser, fmt_reg)
        detect = encoder is not None and tool_call_parser == "auto"
        probe = render_probe_prompt(encoder) if detect else None
        fmt = resolve_tool_format(tool_call_parser, probe, fmt_reg)
        named = resolve_dialect(chat_template_source(encoder), reasoning_dialect, dia_reg)
        dia = with_fallback(named, dia_reg)
        switch = resolve_thinking_switch(encoder)
        shown = f"{switch.kwarg}={switch.off!r}" if switch else "none (the template has none)"
        description = (
            f"tool-call format: {fmt.name or 'none'} ({fmt.reason}); "
            f"reasoning dialect: {dia.name or 'none'} ({dia.reason}); "
            f"thinking switch: {shown}"
        )
        logger.info("%s", description)
        return cls(fmt.format, dia.dialect, description, switch)

    @classmethod
    def from_names(
        cls, tool_call_parser: str = "none", reasoning_dialect: str = "none", registries=None
    ) -> ResponseParser:
        """Explicit names (``none`` for neither); unknown names raise ConfigError."""
        formats = registries.tool_formats if registries else None
        dialects = registries.reasoning_dialects if registries else None
        fmt = resolve_tool_format(tool_call_parser, None, formats)
        dia = resolve_dialect(None, reasoning_dialect, dialects)
        return cls(fmt.format, dia.dialect, f"tool format {fmt.name}, reasoning dialect {dia.name}")

    def special_markers(self, tokenizer: Any) -> list[str]:
        """The format's and dialect's markers that ``tokenizer`` holds as special tokens
        (harmony's ``<|channel|>``, say): a reply decoded without its special tokens would
        reach the reader with them gone, so such requests keep them."""
        fmt, dia = self.tool_format, self.dialect
        markers = {
            *(getattr(fmt, "START_MARKERS", ())), *(getattr(fmt, "CALL_SELF_CLOSERS", ())),
            *(getattr(fmt, "REGION_END_MARKERS", ())), *(getattr(fmt, "WRAPPER_CLOSERS", ())),
            *(getattr(dia, "START_MARKERS", ())), *(getattr(dia, "END_MARKERS", ())),
        }
        return sorted(markers & special_tokens(tokenizer))

    def reader(
        self,
        *,
        prompt: str | None = None,
        starts_in_reasoning: bool | None = None,
        tools: Sequence[Any] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        make_id: Callable[[], str] = new_call_id,
        parallel_tool_calls: bool = True,
    ) -> ResponseReader:
        """A reader for one request. Whether output begins inside the reasoning channel is
        ``starts_in_reasoning`` if given, else read from the rendered ``prompt``."""
        if starts_in_reasoning is None:
            channel = ReasoningChannel.for_prompt(self.dialect, prompt or "")
        else:
            channel = ReasoningChannel(self.dialect, starts_in_reasoning)
        policy = ToolPolicy.from_request(tools, tool_choice, parallel_tool_calls)
        return ResponseReader(channel, self.tool_format, policy, make_id)

    def read_whole(self, text: str, finish_reason: str = "stop", **request: Any) -> ParsedResponse:
        """stream=false: the same reader, fed the whole text once."""
        reader = self.reader(**request)
        reader.feed(text)
        reader.finish(finish_reason)
        return reader.result()


def special_tokens(tokenizer: Any) -> set[str]:
    """The texts a decode with ``skip_special_tokens`` drops: the named special tokens and
    every added token marked special."""
    if tokenizer is None:
        return set()
    names = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return names | {t.content for t in added.values() if getattr(t, "special", False)}
