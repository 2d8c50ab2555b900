"""Grammars that force a tool call: what tool_choice "required" or a named function
becomes (docs/structured_outputs.md).

A format writes the Lark rules of its own call syntax (``ToolFormat.call_rules``) from the
pieces here: markers as literals or special tokens, arguments as ``%json`` of their schema,
and text values that can never hold a closer. ``forced_call_grammar`` puts the reasoning
block the model may write first in front of them. The grammar is llguidance's Lark
dialect (a StructuredSpec of kind "grammar"); once it completes, the engine ends the
sequence on EOS.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from atom_core.errors import InvalidRequestError, UnsupportedError
from atom_core.parsing.reasoning_dialects import ReasoningDialect
from atom_core.parsing.tool_format import ToolFormat
from atom_core.parsing.tool_policy import ToolPolicy
from atom_core.structured.spec import JSON_OPTIONS

# A ceiling on parallel calls, for formats that number their calls in the grammar.
MAX_PARALLEL_CALLS = 8
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}


def literal(text: str, special: Collection[str] = ()) -> str:
    """``text`` as a Lark item: a special token by name where the tokenizer holds it as
    one (its bytes never match a string literal), else a string literal. llguidance names
    a special token by its own text, ``<|call|>``."""
    if text in special:
        return text
    return json.dumps(text, ensure_ascii=False)


def seq(*texts: str, special: Collection[str] = ()) -> str:
    """Consecutive literals; a special token splits a string into its parts."""
    return " ".join(literal(t, special) for t in split_special(texts, special))


def split_special(texts: Sequence[str], special: Collection[str]) -> list[str]:
    """``texts`` cut at every special token they contain, empty pieces dropped."""
    if not special:
        return [t for t in texts if t]
    pattern = re.compile("(" + "|".join(re.escape(s) for s in sorted(special, key=len,
                                                                     reverse=True)) + ")")
    return [p for t in texts for p in pattern.split(t) if p]


def json_item(schema: Mapping[str, Any] | None) -> str:
    """A JSON value matching ``schema``, written compactly (spec.py says why)."""
    body = dict(schema) if isinstance(schema, Mapping) else dict(ANY_OBJECT)
    body["x-guidance"] = JSON_OPTIONS
    return "%json " + json.dumps(body, ensure_ascii=False)


def is_text(schema: Mapping[str, Any] | None) -> bool:
    """Whether an XML-shaped format writes this property's value as bare text: where its
    reader keeps the text as written (coerce.py), because a string is allowed or every
    allowed value is one."""
    if not isinstance(schema, Mapping):
        return False
    kinds = schema.get("type")
    if kinds == "string" or (isinstance(kinds, list) and "string" in kinds):
        return True
    if isinstance(schema.get("const"), str):
        return True
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        return True
    return any(is_text(sub) for key in ("anyOf", "oneOf") for sub in schema.get(key) or ())


def text_terminal(schema: Mapping[str, Any], forbidden: Sequence[str]) -> str:
    """A Lark terminal for a string property's bare text: its ``enum``/``const`` as
    literals, else free text within ``minLength``/``maxLength`` that never holds one of
    ``forbidden`` (the closers a reader would stop at)."""
    if "const" in schema and isinstance(schema["const"], str):
        return literal(schema["const"])
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        return "(" + " | ".join(literal(e) for e in enum) + ")"
    low = schema.get("minLength", 0)
    high = schema.get("maxLength")
    low = low if isinstance(low, int) and low >= 0 else 0
    bound = f"{low},{high}" if isinstance(high, int) and high >= low else f"{low},"
    text = f"/(?s:.{{{bound}}})/"
    if not forbidden:
        return text
    alternatives = "|".join(_regex_escape(f) for f in forbidden)
    return f"{text} & ~/(?s:.*)({alternatives})(?s:.*)/"


def value_rule(name: str, schema: Mapping[str, Any], forbidden: Sequence[str], closer: str,
               special: Collection[str] = ()) -> tuple[str, str]:
    """(the item, its rules) for one argument value of an XML-shaped format and the
    ``closer`` after it: a string property's bare text (``text_terminal``), any other as
    JSON. Text and a plain closer form one terminal: as two lexemes, the text would take
    the closer's first bytes wherever its length allows (lexemes are greedy)."""
    if not is_text(schema):
        item = name.lower()
        return item, f"{item}: {json_item(schema)} {seq(closer, special=special)}"
    text = text_terminal(schema, forbidden)
    if any(s in closer for s in special):
        item = name.lower()
        return item, f"{item}: {name.upper()} {seq(closer, special=special)}\n" \
                     f"{name.upper()}: {text}"
    item = name.upper()
    return item, f"{item}: ({text}) {literal(closer)}"


def _regex_escape(text: str) -> str:
    return re.escape(text).replace("/", "\\/")


def properties(schema: Mapping[str, Any] | None) -> list[tuple[str, Mapping[str, Any], bool]]:
    """(name, schema, required) of each declared property, in declared order."""
    if not isinstance(schema, Mapping):
        return []
    props = schema.get("properties")
    required = set(schema.get("required") or ())
    if not isinstance(props, Mapping):
        return []
    return [(k, v if isinstance(v, Mapping) else {}, k in required) for k, v in props.items()]


def repeat(item: str, parallel: bool, sep: str = "") -> str:
    """One ``item``, or one or more (``sep`` between them) when ``parallel``."""
    if not parallel:
        return item
    return f"{item} ({sep + ' ' if sep else ''}{item})*"


def rule_name(prefix: str, index: int) -> str:
    return f"{prefix}_{index}"


def reasoning_rules(dialect: ReasoningDialect | None, prompt: str,
                    special: Collection[str] = ()) -> tuple[str, str]:
    """The reasoning block a reply may begin with: (the item that goes before the calls,
    the rules it uses), both empty when there is none.

    A prompt that left the channel open (DeepSeek-R1's ``<think>\\n``) makes the reply
    begin inside it: free text up to the dialect's end marker, then the calls. A prompt
    that closed it (Qwen3's thinking switch off writes ``<think>\\n\\n</think>``) has no
    block. Otherwise the reply may open one. The text is lazy: it ends at the first end
    marker."""
    if dialect is None or not dialect.END_MARKERS:
        return "", ""
    tail = prompt.rstrip()
    if tail.endswith(tuple(dialect.END_MARKERS)):
        return "", ""
    ends = list(dialect.END_MARKERS)
    ws = '/[ \\t\\r\\n]{0,4}/'
    if any(p in special for p in split_special(ends, special)):  # Kimi-K3's <|close|>think
        end = "(" + " | ".join(seq(e, special=special) for e in ends) + ")"
        body = f"reasoning_text {end}"
        rules = "reasoning_text: /(?s:.*)/\n"
    else:
        body = "reasoning_text"
        ends_terminal = " | ".join(literal(e) for e in ends)
        rules = (f"REASONING_END: {ends_terminal}\n"
                 "reasoning_text[suffix=REASONING_END]: /(?s:.*)/\n")
    if dialect.prompt_opens_channel(prompt):
        return f"reasoning {ws}", f"reasoning: {body}\n{rules}"
    starts = " | ".join(seq(s, special=special) for s in dialect.START_MARKERS)
    return f"(reasoning {ws})?", f"reasoning: ({starts}) {body}\n{rules}"


def forced_call_grammar(
    fmt: ToolFormat | None,
    dialect: ReasoningDialect | None,
    prompt: str,
    tools: Sequence[Any] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool = True,
    special: Collection[str] = (),
) -> str | None:
    """The grammar a reply must match when ``tool_choice`` forces a call, else None.

    "required" (Anthropic's "any"): one or more calls of the declared functions, exactly
    one when ``parallel_tool_calls`` is false; named: one call of that function. A format
    that cannot write the grammar is a 400 naming it, never a reply that silently calls
    nothing."""
    policy = ToolPolicy.from_request(tools, tool_choice, parallel_tool_calls)
    if policy.choice not in ("required", "named") or not policy.tools:
        return None
    shown = "named function" if policy.choice == "named" else "'required'"
    if fmt is None:
        raise InvalidRequestError(
            f"tool_choice {shown} needs the model's tool-call format, and this server has "
            "none (start it with --tool-call-parser)", param="tool_choice")
    if policy.choice == "named":
        assert policy.named is not None
        functions = {policy.named: policy.tools[policy.named]}
    else:
        functions = dict(policy.tools)
    parallel = policy.choice == "required" and parallel_tool_calls
    try:
        calls = fmt.call_rules(functions, parallel, frozenset(special))
    except UnsupportedError:
        raise InvalidRequestError(
            f"tool_choice {shown} is not supported with the {fmt.name} tool-call format",
            param="tool_choice") from None
    before, rules = reasoning_rules(dialect, prompt, special)
    return f"start: {before} calls\n{rules}{calls}"
