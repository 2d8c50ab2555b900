"""Replies whose tool or reasoning markers are special tokens (gpt-oss's harmony) decode
with the special tokens kept, or the reader would never see the markers; other replies
drop them as before, and a request may ask for them with vLLM's skip_special_tokens."""

from __future__ import annotations

import copy

import pytest

from atom_core.engine.output import RequestText
from atom_core.sampling_params import SamplingParams
from tests.entrypoints.http.asgi_app import post
from tests.entrypoints.http.scripted_engine import ScriptedEngine
from tests.parsing.shared_templates import template_path
from tests.tiny_tokenizer import tiny_tokenizer

HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
           "<|constrain|>"]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def harmony_tokenizer():
    tok = copy.deepcopy(tiny_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": HARMONY})
    return tok


def test_request_text_keeps_special_tokens_when_asked():
    tok = harmony_tokenizer()
    ids = tok.encode("<|channel|>final<|message|>Sunny", add_special_tokens=False)
    kept = RequestText(tok, [], SamplingParams(skip_special_tokens=False))
    dropped = RequestText(tok, [], SamplingParams())
    assert kept.update(ids, "length")[0] == "<|channel|>final<|message|>Sunny"
    assert dropped.update(ids, "length")[0] == "finalSunny"


@pytest.mark.parametrize("special", [True, False])
def test_a_chat_reply_keeps_special_tokens_only_where_its_markers_are_special(special):
    eng = ScriptedEngine("<|channel|>final<|message|>Sunny",
                         chat_template=template_path("gpt_oss").read_text())
    if special:
        eng.tokenizer = harmony_tokenizer()
        eng.vocab_size = len(eng.tokenizer)
    r = post(eng, "/v1/chat/completions", {"messages": USER, "max_tokens": 100})
    assert r.status_code == 200, r.text
    assert eng.params[0].skip_special_tokens is not special
    r = post(eng, "/v1/messages", {"model": "scripted", "messages": USER, "max_tokens": 100})
    assert r.status_code == 200, r.text
    assert eng.params[1].skip_special_tokens is not special


def test_a_request_asks_for_special_tokens_with_skip_special_tokens():
    eng = ScriptedEngine("text")
    r = post(eng, "/v1/completions", {"prompt": "x", "skip_special_tokens": False})
    assert r.status_code == 200, r.text
    r = post(eng, "/v1/completions", {"prompt": "x"})
    assert r.status_code == 200, r.text
    assert [p.skip_special_tokens for p in eng.params] == [False, True]
