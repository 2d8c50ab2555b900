"""gpt-oss's harmony format: every message names its channel, and a tool call is a
message addressed to ``functions.NAME``.

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>
    commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(one line on the wire). The output begins after the prompt's ``<|start|>assistant``.
``analysis`` is reasoning, split off by the dialect below. ``final`` is the answer and
``commentary`` without a recipient is a preamble the user sees; both are content, and
their headers, ``<|start|>assistant``, ``<|end|>`` and ``<|return|>`` are framing the tool
stage drops where they stand. A message with a recipient is a region: the recipient may
follow the channel (as the model writes it) or the role (as the template writes history:
``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>``).

A call is its header, complete up to ``<|message|>``, and then its body; the name goes out
once the header is complete. The body ends at ``<|call|>``, or ``<|end|>``/``<|return|>``
where a model writes those instead, or at the end of the stream: ``<|call|>`` is a stop
token, and the engine drops the token that stopped a request. The arguments are the JSON
object the body begins with (a cut one is closed); a body that holds anything else, or
more, gives the rest back as content and the call is made with what was read (``{}`` when
nothing was). A recipient outside ``functions.`` (the built-in browser and python tools)
or a header that is not one is not a call: the text reaches the client as written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from typing import Any

from atom_core.parsing import ReasoningDialect, RegionParse, ToolCall, ToolFormat
from atom_core.parsing.call_grammar import json_item, rule_name, seq
from atom_toolformats._syntax import NAME, first_of, json_arguments, read_json, skip_ws

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
ROLE = START + "assistant"
TO = " to="
FUNCTIONS = "functions."


def header(channel: str) -> str:
    return f"{CHANNEL}{channel}{MESSAGE}"


ANALYSIS = header("analysis")
OPENERS = (f"{CHANNEL}commentary{TO}", f"{CHANNEL}analysis{TO}", ROLE + TO)
FRAMING = (ROLE, header("final"), header("commentary"), ANALYSIS, END, RETURN, CALL)
CLOSERS = (CALL, END, RETURN)

# What may stand between a call's name and <|message|>: the channel (when the recipient
# follows the role), the content type with or without <|constrain|>. Bounded, so that a
# quoted opener is rejected without reading on.
_HEADER_REST = re.compile(
    r"\s*(?:<\|channel\|>\w+\s*)?(?:<\|constrain\|>\s*)?(?:\w+\s*)?<\|message\|>"
)
HEADER_WINDOW = 96


class HarmonyFormat(ToolFormat):
    name = "harmony"
    START_MARKERS = (*OPENERS, *FRAMING)
    CALL_SELF_CLOSERS = CLOSERS
    TEMPLATE_SIGNATURE = (TO + FUNCTIONS, f"{CHANNEL}commentary", CALL)

    def opens_region(self, marker: str) -> bool:
        return marker in OPENERS

    def parse_region(self, text: str, at_end: bool) -> RegionParse | None:
        opener = next((o for o in OPENERS if text.startswith(o)), "")
        i = len(opener)
        if not opener or not text.startswith(FUNCTIONS, i):
            return None
        name = NAME.match(text, i + len(FUNCTIONS))
        if name is None:
            return None
        head = _HEADER_REST.match(text, name.end(), min(len(text), name.end() + HEADER_WINDOW))
        if head is None:
            return None  # still arriving, or not a header: either way not (yet) a call
        close, closer = first_of(text, CLOSERS, head.end())
        if close < 0 and not at_end:
            return RegionParse([ToolCall(name.group())])  # named; the body is arriving
        body_end = close if close >= 0 else len(text)
        args, used = read_body(text, head.end(), body_end)
        markup_end = close + len(closer) if close >= 0 else len(text)
        if used < body_end:  # what the body holds beyond its object is the answer's
            markup_end = used
        return RegionParse([ToolCall(name.group(), args)], 0, markup_end)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        args = json.dumps(arguments, ensure_ascii=False)
        return f"{OPENERS[0]}{FUNCTIONS}{name} <|constrain|>json{MESSAGE}{args}{CALL}"

    def call_rules(self, functions: Mapping[str, Mapping[str, Any] | None], parallel: bool,
                   special: Collection[str] = frozenset()) -> str:
        # One call whatever ``parallel`` says: <|call|> is a stop token, so it ends the
        # turn. The role opens the message after an analysis one; a reply that begins
        # with the call has it in the prompt already.
        fns = [f"{rule_name('fn', i)}: {seq(f'{OPENERS[0]}{FUNCTIONS}{name} ', special=special)} "
               f"{seq('<|constrain|>json' + MESSAGE, special=special)} {json_item(schema)} "
               f"{seq(CALL, special=special)}"
               for i, (name, schema) in enumerate(functions.items())]
        alternatives = " | ".join(rule_name("fn", i) for i in range(len(functions)))
        return (f"calls: ({seq(ROLE, special=special)})? call\ncall: {alternatives}\n"
                + "\n".join(fns) + "\n")


def read_body(text: str, start: int, end: int) -> tuple[dict[str, Any], int]:
    """The arguments in ``text[start:end]`` and how far they reach: the whole body when it
    is one JSON object (cut or not) between whitespace, else the end of the value read
    (``start`` when none was)."""
    body = text[start:end]
    i = skip_ws(body, 0)
    if i == len(body):
        return {}, end
    read = read_json(body, i, True)
    args = json_arguments(read[0]) if read is not None else None
    if args is None:
        return {}, start
    stop = read[1]
    return args, end if skip_ws(body, stop) == len(body) else start + stop


class HarmonyDialect(ReasoningDialect):
    """The ``analysis`` channel. ``<|end|>`` closes it; outside it that token is framing
    the tool stage drops."""

    name = "harmony"
    START_MARKERS = (ANALYSIS,)
    END_MARKERS = (END,)
    TEMPLATE_SIGNATURE = (ANALYSIS,)
    DETECT_PRIORITY = 10
