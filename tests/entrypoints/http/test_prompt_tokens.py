"""prompt_tokens: the characters-per-token bound is sound (never refuses a prompt that
fits), the direct Rust call gives transformers' ids, and work runs off the event loop."""

from __future__ import annotations

import asyncio
import copy
import random
import threading
import unicodedata

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast

from atom_core.entrypoints.http.openai.chat import OpenAIServingChat
from atom_core.entrypoints.http.prompt_tokens import (
    NFC_MAX_FOLD,
    PromptTokenizer,
    byte_chars,
    char_bound,
    off_loop,
    trimmed_len,
)
from atom_core.errors import InvalidRequestError
from atom_core.testing.tiny_models import tiny_model_dir
from tests.entrypoints.http.fake_engine import FakeEngineClient
from tests.tiny_tokenizer import tiny_tokenizer

SAMPLES = [
    "Hello world! How are you today?",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "你好，世界。" * 7 + " 🙂🙂 e\u0301 \U0001f1eb\U0001f1f7",
    "    def add(a, b):\n        return a + b\n" * 3,
    "a" * 300,
    " " * 200 + "\n" * 50,
    "\x04\x06\x13" * 100 + "x",  # SmolLM2's vocabulary lacks these: they are dropped
]


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def tokenizer_kinds(tiny_llama):
    """The tokenizers a server here meets: a trained byte-level BPE, the tiny test
    model's (bytes only) and the embedded SmolLM2's (from its GGUF)."""
    from atom_core.loader import embedded_model_path
    from atom_core.loader.gguf_loader import GGUFFile

    smollm2 = GGUFFile(embedded_model_path()).load_tokenizer()
    return {"trained": tiny_tokenizer(), "tiny_llama": tiny_llama, "smollm2": smollm2}


KINDS = ["trained", "tiny_llama", "smollm2"]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = "ab \n\t.,<|>émð你🙂\u0301\x04\x1d\U00040000"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400))) for _ in range(n)]


@pytest.mark.parametrize("which", KINDS)
def test_the_bound_never_exceeds_the_real_count(which, tokenizer_kinds):
    tok = tokenizer_kinds[which]
    bound = char_bound(tok)
    assert bound is not None and bound.longest >= len("<|endoftext|>")
    for text in SAMPLES + _random_texts(200):
        n = len(tok.encode(text, add_special_tokens=False))
        at_least = bound.at_least([text], 1)
        assert at_least is None or at_least <= n, (text, at_least, n)
        assert bound.at_least([text], n + 1) is None, text  # never refuses what fits


def test_smollm2_drops_the_control_characters_its_vocabulary_lacks(tokenizer_kinds):
    tok = tokenizer_kinds["smollm2"]
    bound = char_bound(tok)
    assert set(bound.droppable) == {"\x04", "\x06", "\x13", "\x14", "\x16", "\x1d"}
    text = "\x04" * 100_000 + "hi"
    assert len(tok.encode(text, add_special_tokens=False)) < 5
    assert bound.at_least([text], 5) is None
    assert bound.at_least(["hi" * 100_000], 100) is not None  # what it is for still holds


def test_byte_chars_is_the_byte_level_alphabet():
    assert sorted(byte_chars().values()) == sorted(ByteLevel.alphabet())


def test_nfc_folds_at_most_nfc_max_fold_characters_into_one():
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000)
                  if not 0xD800 <= c < 0xE000)
    assert longest == NFC_MAX_FOLD


def test_an_nfc_byte_level_bpe_is_bounded_with_the_fold():
    base = tiny_tokenizer()
    backend = Tokenizer.from_str(base.backend_tokenizer.to_str())
    backend.normalizer = normalizers.NFC()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert char_bound(tok).fold == NFC_MAX_FOLD and char_bound(base).fold == 1
    decomposed = "e\u0301\u0302" * 50 + "\u1100\u1161\u11a8" * 50  # NFC folds these
    at_least = char_bound(tok).at_least([decomposed], 1)
    assert at_least is not None and len(tok.encode(decomposed)) >= at_least


def test_kinds_without_a_proof_have_no_bound():
    # WordPiece folds an unknown word into one [UNK]; a Strip normalizer drops characters.
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    assert char_bound(PreTrainedTokenizerFast(tokenizer_object=wp)) is None
    stripped = Tokenizer.from_str(tiny_tokenizer().backend_tokenizer.to_str())
    stripped.normalizer = normalizers.Strip()
    assert char_bound(PreTrainedTokenizerFast(tokenizer_object=stripped)) is None


@pytest.mark.parametrize("which", KINDS)
@pytest.mark.parametrize("special", [False, True])
def test_the_direct_call_gives_transformers_ids(which, special, tokenizer_kinds):
    tok = tokenizer_kinds[which]
    pt = PromptTokenizer(tok)
    assert pt._backend is not None  # the fast path is the one under test
    for text in SAMPLES + _random_texts(50, seed=1):
        expected = tok.encode(text, add_special_tokens=special)
        assert pt.encode(text, special, 10**6, "prompt") == expected


def test_a_prompt_beyond_the_context_is_refused_before_tokenizing():
    pt = PromptTokenizer(tiny_tokenizer())
    calls = []
    pt._backend = None  # what is called is then tokenizer.encode: record it
    def encode(self, t, **kw):
        return calls.append(t) or [1] * len(t)

    pt.tokenizer = type("T", (), {"encode": encode})()
    with pytest.raises(InvalidRequestError, match="at least") as err:
        pt.encode("x" * (pt.bound.longest * 256), False, 256, "prompt")
    assert err.value.param == "prompt" and calls == []
    with pytest.raises(InvalidRequestError, match="has 300 tokens"):
        pt.encode("x" * 300, False, 256, "prompt")  # under the bound: counted, then refused


def test_the_exact_count_refuses_what_fills_the_context():
    tok = tiny_tokenizer()
    pt = PromptTokenizer(tok)
    text = "Hello world! " * 40
    n = len(tok.encode(text, add_special_tokens=False))
    assert pt.encode(text, False, n + 1, "messages") == tok.encode(text, add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match=f"has {n} tokens") as err:
        pt.encode(text, False, n, "messages")
    assert err.value.param == "messages"


def test_off_loop_runs_on_a_worker_thread():
    async def main() -> tuple[int, int]:
        return threading.get_ident(), await off_loop(threading.get_ident)

    loop_thread, worker_thread = asyncio.run(main())
    assert loop_thread != worker_thread


def test_trimmed_len_is_the_stripped_length_without_copying_the_middle():
    rng = random.Random(2)
    cases = ["", " ", "a", " a ", "\u3000x\x1c", "a" * 100 + " " * 1000, " " * 5000,
             "x" + " " * 200 + "y "]
    cases += ["".join(rng.choice(" \t\nab\u3000") for _ in range(rng.randint(0, 300)))
              for _ in range(500)]
    for text in cases:
        assert trimmed_len(text) == len(text.strip()), repr(text)


def test_user_text_beyond_the_context_is_refused_before_the_template_runs():
    engine = FakeEngineClient(max_model_len=64)
    chat = OpenAIServingChat(engine)
    rendered = []
    real = engine.tokenizer.apply_chat_template
    engine.tokenizer = copy.copy(engine.tokenizer)
    engine.tokenizer.apply_chat_template = lambda *a, **kw: rendered.append(1) or real(*a, **kw)
    chat.tokens = PromptTokenizer(engine.tokenizer)
    longest = chat.tokens.bound.longest

    def render(content: str, role: str = "user") -> tuple[str, list[int]]:
        messages = [{"role": role, "content": content}]
        return chat._render_prompt(messages, None, {"add_generation_prompt": True})

    with pytest.raises(InvalidRequestError, match="at least") as err:
        render("x" * (longest * 64))
    assert err.value.param == "messages" and rendered == []
    # Whitespace a template may trim does not count; other roles' text is rendered first.
    cases = ((" " * (longest * 64) + "hi", "user"), ("x" * (longest * 64), "assistant"))
    for content, role in cases:
        with pytest.raises(InvalidRequestError):
            render(content, role)
        assert rendered, role
        rendered.clear()
    assert render("hi")[1]  # what fits is rendered and tokenized
