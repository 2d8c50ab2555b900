"""A request's output constraint (``StructuredSpec``) and the grammar it stands for.

A spec is plain data: it rides in SamplingParams from the HTTP frontend to the engine
process (msgspec) and keys the engine's compile cache. It turns into llguidance's grammar
text here, on both sides: the frontend validates it (``validate``, a 400 naming the
request field), the engine compiles it against the tokenizer (structured/compiler.py).

JSON is written compactly, as ``json.dumps`` writes it (", " and ": ", no other
whitespace): a model that may emit free whitespace can emit it forever and never close the
object, and a small one does.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import xxhash

from atom_core.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar")
ANY_JSON_OBJECT = '{"type": "object"}'  # OpenAI's response_format {"type": "json_object"}
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredSpec:
    """What the generated text must match.

    ``kind``/``value``: "json" and a JSON schema as JSON text; "regex" and a regular
    expression (Rust regex syntax); "choice" and a JSON list of the allowed strings;
    "grammar" and a grammar in llguidance's Lark dialect or llama.cpp's GBNF. The Lark
    dialect embeds JSON schemas (``%json {...}``) and matches special tokens by name
    (``<|im_end|>``): a grammar built from a tool format's markers and a function's
    parameters is a "grammar" spec like any other. ``param``: the request field it came
    from, named in errors.
    """

    kind: str
    value: str
    param: str = "response_format"

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, param: str = "response_format"
                    ) -> StructuredSpec:
        # Not sort_keys: the properties' order is the order the output writes them in.
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json", text, param)

    @classmethod
    def choice(cls, choices: list[str], param: str = "guided_choice") -> StructuredSpec:
        return cls("choice", json.dumps(list(choices)), param)

    @property
    def key(self) -> int:
        """The compile cache's key: equal specs compile once."""
        return xxhash.xxh3_64_intdigest(f"{self.kind}\0{self.value}".encode())

    def grammar(self) -> str:
        """llguidance's grammar text for this spec (not yet checked: ``validate``)."""
        return _grammar(self.kind, self.value)

    def validate(self) -> None:
        """InvalidRequestError naming ``param`` when the spec cannot be compiled: an
        unknown kind, a schema that is not JSON or that no value satisfies, a regex or
        grammar that does not parse. No tokenizer is needed: what is checked here is what
        the engine's compile would refuse."""
        problem = _problem(self.kind, self.value)
        if problem:
            raise InvalidRequestError(f"{self.param}: {problem}", param=self.param)


def _grammar(kind: str, value: str) -> str:
    import llguidance

    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind in ("choice", "grammar"):
        return llguidance.grammar_from(kind, value)
    raise ValueError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")


@functools.lru_cache(maxsize=256)
def _problem(kind: str, value: str) -> str:
    """Why the spec cannot be compiled ("" when it can). Cached: a batch of prompts, or
    n choices, share one spec, and each is checked."""
    import llguidance

    try:
        if kind == "choice":
            choices = json.loads(value)
            if not isinstance(choices, list) or not choices or not all(
                isinstance(c, str) for c in choices
            ):
                return "must be a non-empty list of strings"
        grammar = _grammar(kind, value)
    except ValueError as exc:  # not JSON, an unknown kind
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar).strip()
