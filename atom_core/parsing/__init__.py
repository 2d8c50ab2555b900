"""Reading a model's reply: tool calls, the reasoning channel, and the chat template they
are detected from. Public: format plugins build on it, the server and ``atom parse`` drive it.

What a format plugin imports is here: ``ToolFormat`` (with ``ToolCall`` and
``RegionParse``), ``ReasoningDialect``, and the partial-JSON reader. What a server drives
is ``atom_core.parsing.response`` (``ResponseParser`` per model, ``ResponseReader`` per
request). The modules:

- ``tool_format``: the contract a tool-call format implements (syntax only);
- ``tool_stream``: the one reader of a tool-call stream, for every format;
- ``tool_detection``: which format a model emits, resolved once at start-up;
- ``tool_policy``: what ``tools`` and ``tool_choice`` let the reader dispatch;
- ``reasoning_dialects``, ``reasoning``: the reasoning channel's delimiters, and its split;
- ``marker_scanner``: how much of a stream is safe to release;
- ``events``: what a reader hands a server;
- ``partial_json``, ``coerce``: arguments cut short, and typed by the tool's schema;
- ``chat_encoders``: rendering the chat template, and the start-up probes of it.
"""

from atom_core.parsing.partial_json import PartialStr, parse_json_prefix
from atom_core.parsing.reasoning_dialects import ReasoningDialect
from atom_core.parsing.tool_format import RegionParse, ToolCall, ToolFormat

__all__ = [
    "PartialStr",
    "ReasoningDialect",
    "RegionParse",
    "ToolCall",
    "ToolFormat",
    "parse_json_prefix",
]
