"""StructuredSpec's check, the compile cache, a matcher's walk through a grammar and the
batched bitmask, on the tiny byte-level tokenizer (256 byte tokens, EOS 258)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from atom_core.errors import InvalidRequestError
from atom_core.structured import GrammarCompiler, StructuredSpec, fill_bitmask
from atom_core.testing.tiny_models import EOS_TOKEN_ID, VOCAB_SIZE, tiny_model_dir

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB_SIZE, [EOS_TOKEN_ID])


def allowed(bitmask: torch.Tensor, row: int = 0) -> list[int]:
    return [t for t in range(VOCAB_SIZE) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1]


@pytest.mark.parametrize(("spec", "words"), [
    (StructuredSpec("regex", "a(b", "guided_regex"), "unclosed group"),
    (StructuredSpec("json", '{"type": "objectx"}', "guided_json"), "objectx"),
    (StructuredSpec("json", "{not json", "guided_json"), "key must be a string"),
    (StructuredSpec("json", '{"type": "string", "minLength": 5, "maxLength": 2}',
                    "response_format"), "Unsatisfiable"),
    (StructuredSpec("grammar", "start: x", "guided_grammar"), 'unknown name: "x"'),
    (StructuredSpec("choice", "[]", "guided_choice"), "non-empty list"),
    (StructuredSpec("choice", '["a", 1]', "guided_choice"), "non-empty list"),
    (StructuredSpec("xml", "<a/>", "response_format"), "unknown constraint kind"),
])
def test_a_spec_that_cannot_compile_names_its_field(spec, words):
    with pytest.raises(InvalidRequestError, match=words) as info:
        spec.validate()
    assert info.value.param == spec.param


@pytest.mark.parametrize("spec", [
    StructuredSpec.json_schema(SCHEMA),
    StructuredSpec("regex", "[0-9]{3}-[a-z]+", "guided_regex"),
    StructuredSpec.choice(['say "hi"', "back\\slash", "a|b"]),
    StructuredSpec("grammar", 'start: "yes" | "no"', "guided_grammar"),
    StructuredSpec("grammar", 'root ::= "yes" | "no"', "guided_grammar"),  # GBNF
    StructuredSpec("grammar", "start: %json {\"type\": \"integer\"}", "guided_grammar"),
])
def test_well_formed_specs_validate(spec):
    spec.validate()


def test_equal_specs_share_a_key_and_one_compile(compiler):
    a, b = StructuredSpec.json_schema(SCHEMA), StructuredSpec.json_schema(dict(SCHEMA))
    assert a == b and a.key == b.key
    assert StructuredSpec("regex", a.value).key != a.key  # the kind is part of the key
    compiler.matcher(a)
    template = compiler._cache[a.key][1]
    compiler.matcher(b)
    assert compiler._cache[a.key][1] is template


def test_the_cache_is_bounded(tokenizer):
    small = GrammarCompiler(tokenizer, VOCAB_SIZE, [EOS_TOKEN_ID], capacity=2)
    specs = [StructuredSpec("regex", f"x{i}") for i in range(3)]
    for spec in specs:
        small.matcher(spec)
    assert list(small._cache) == [specs[1].key, specs[2].key]


def test_a_matcher_walks_the_grammar_then_allows_eos_alone(compiler, tokenizer):
    m = compiler.matcher(StructuredSpec.json_schema(SCHEMA))
    assert allowed(fill_bitmask([m], VOCAB_SIZE)) == [ord("{")]
    for token in tokenizer.encode('{"a": 12', add_special_tokens=False):
        assert not m.accept(token)
    digits_or_close = allowed(fill_bitmask([m], VOCAB_SIZE))
    assert digits_or_close == sorted([ord(c) for c in "0123456789}"])
    assert not m.accept(ord("}"))  # complete, but the sequence ends on EOS
    assert m.is_accepting
    assert allowed(fill_bitmask([m], VOCAB_SIZE)) == [EOS_TOKEN_ID]
    assert m.accept(EOS_TOKEN_ID)


def test_a_refused_token_ends_the_sequence(compiler):
    m = compiler.matcher(StructuredSpec("regex", "[0-9]+"))
    assert m.accept(ord("x"))


def test_batched_fill_equals_one_at_a_time(compiler, tokenizer):
    specs = [StructuredSpec.json_schema(SCHEMA), StructuredSpec("regex", "[a-c]+x"),
             StructuredSpec.choice(["yes", "no"])]
    matchers = [compiler.matcher(s) for s in specs]
    for m, text in zip(matchers, ['{"a"', "ab", "y"]):
        for token in tokenizer.encode(text, add_special_tokens=False):
            m.accept(token)
    batched = fill_bitmask(matchers, VOCAB_SIZE)
    assert batched.shape == (3, (VOCAB_SIZE + 31) // 32)
    for i, m in enumerate(matchers):
        assert torch.equal(batched[i], fill_bitmask([m], VOCAB_SIZE)[0])
    assert allowed(batched, 2) == [ord("e")]


def test_a_model_without_a_tokenizer_refuses_constraints():
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        GrammarCompiler(None, VOCAB_SIZE, []).matcher(StructuredSpec("regex", "a"))


def test_a_tokenizer_llguidance_cannot_read_refuses_constraints():
    with pytest.raises(InvalidRequestError, match="not available for this model's tokenizer"):
        GrammarCompiler(object(), VOCAB_SIZE, []).matcher(StructuredSpec("regex", "a"))
