"""ToolPolicy: what a request allows the parser to dispatch (tools + tool_choice).

The format is always read, whatever the policy: a region is parsed exactly as a
permitted call's would be, and the policy only decides whether each call is dispatched.
What each choice means for a parser, which cannot make a model call anything:

``auto``      every call is dispatched. With no tool list (``tools=None``, as ``atom parse``
              without ``--tools``) any name is; a name goes out early only for a declared tool.
``none``      no call is dispatched. Its markup is dropped and the answer around it is
              delivered, so a reply that was nothing but a forbidden call has empty content.
``required``  every call to a declared tool is dispatched (calls to undeclared names are
              dropped like forbidden ones); ``required_unmet`` on the response reports a
              reply that called nothing, for the server to act on.
named         (``{"type": "function", "function": {"name": X}}``, or Anthropic's
              ``{"type": "tool", "name": X}``) only calls to X are dispatched; others are
              dropped like forbidden ones.

Anthropic spellings are accepted too: ``{"type": "auto" | "any" | "none"}``.

``parallel`` False (OpenAI's ``parallel_tool_calls: false``, Anthropic's
``disable_parallel_tool_use``) dispatches at most one call: the first permitted one; later
calls are dropped like forbidden ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from atom_core.errors import InvalidRequestError


def _tool_entry(tool: Any) -> tuple[str, Mapping[str, Any] | None]:
    if not isinstance(tool, Mapping):
        raise InvalidRequestError("each tool must be an object", param="tools")
    fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("each tool needs a non-empty string name", param="tools")
    schema = fn.get("parameters", fn.get("input_schema"))
    return name, schema if isinstance(schema, Mapping) else None


@dataclass(frozen=True)
class ToolPolicy:
    """Declared tools (name -> JSON schema of the arguments) and the tool choice."""

    tools: Mapping[str, Mapping[str, Any] | None] | None = None
    choice: str = "auto"  # auto | none | required | named
    named: str | None = None
    _declared: frozenset[str] = field(default=frozenset(), repr=False)
    parallel: bool = True

    @classmethod
    def from_request(
        cls, tools: Sequence[Any] | None = None, tool_choice: str | Mapping[str, Any] | None = None,
        parallel: bool = True,
    ) -> ToolPolicy:
        """From OpenAI (or Anthropic) request fields; bad input raises InvalidRequestError."""
        declared = None if tools is None else dict(_tool_entry(t) for t in tools)
        choice, named = cls._read_choice(tool_choice)
        if named is not None and declared is not None and named not in declared:
            raise InvalidRequestError(
                f"tool_choice names {named!r}, which is not in tools", param="tool_choice"
            )
        return cls(declared, choice, named, frozenset(declared or ()), parallel)

    @staticmethod
    def _read_choice(tool_choice: str | Mapping[str, Any] | None) -> tuple[str, str | None]:
        if tool_choice is None:
            return "auto", None
        if isinstance(tool_choice, str):
            if tool_choice in ("auto", "none", "required"):
                return tool_choice, None
        elif isinstance(tool_choice, Mapping):
            kind = tool_choice.get("type")
            fn = tool_choice.get("function")
            name = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
            if kind in ("function", "tool") and isinstance(name, str) and name:
                return "named", name
            if kind in ("auto", "none"):
                return kind, None
            if kind == "any":
                return "required", None
        raise InvalidRequestError(
            "tool_choice must be 'auto', 'none', 'required' or name a function", param="tool_choice"
        )

    def dispatches(self, name: str) -> bool:
        """Whether a parsed call to ``name`` reaches the client."""
        if self.choice == "none":
            return False
        if self.choice == "named":
            return name == self.named
        if self.choice == "required" and self.tools is not None:
            return name in self._declared
        return True

    def announces(self, name: str) -> bool:
        """Whether ``name`` may go out before the call is complete: only for a tool the
        request declared (prose can name a real tool; declared is the other half)."""
        return name in self._declared and self.dispatches(name)

    def schema(self, name: str) -> Mapping[str, Any] | None:
        return None if self.tools is None else self.tools.get(name)
