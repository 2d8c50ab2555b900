"""Incremental detokenization, stop strings, and RequestText: one request's text and
the finish reason a stop string gives."""

import random

import pytest
from tokenizers import decoders

from atom_core.engine.output import IncrementalDetokenizer, RequestText, fast_decoder
from atom_core.sampling_params import SamplingParams
from tests.tiny_tokenizer import SPECIAL, tiny_tokenizer

TEXTS = [
    "Hello world! The quick brown fox.",
    "emoji 🙂🚀 and accents: café, naïve",
    "中文：你好，世界。混合 text 与 emoji 🎉",
    "code:\n    return a + b\n",
]


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = []
    for t in ids:
        detok.add_token(t)
        pieces.append(detok.release())
        if detok.stopped_on is not None:
            break
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(text):
    tok = tiny_tokenizer()
    prompt = tok.encode("Hello there. ")
    ids = tok.encode(text)
    pieces = _stream(IncrementalDetokenizer(tok, prompt), ids)
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_multibyte_characters_span_tokens_in_this_tokenizer():
    # Guards the test above: the tokenizer must really split a character across tokens.
    tok = tiny_tokenizer()
    ids = tok.encode("🙂")
    assert len(ids) > 1
    assert all("\ufffd" in tok.decode([i]) or tok.decode([i]) == "" for i in ids)


def test_random_token_streams_match_full_decode():
    tok = tiny_tokenizer()
    rng = random.Random(0)
    special = set(tok.convert_tokens_to_ids(SPECIAL))
    vocab = [i for i in range(len(tok)) if i not in special]
    for _ in range(50):
        ids = [rng.choice(vocab) for _ in range(rng.randint(1, 30))]
        got = "".join(_stream(IncrementalDetokenizer(tok, []), ids))
        assert got == tok.decode(ids)


def _byte_token(tok, byte: int) -> int:
    """The tiny tokenizer's token for one raw byte. Byte-level BPE (GPT-2's) spells the
    printable bytes as their own Latin-1 characters and the others, in order, from U+0100."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(0x100 + others.index(byte))
    token = tok.convert_tokens_to_ids(char)
    assert tok.convert_ids_to_tokens(token) == char  # in the vocabulary, not unknown
    return token


def test_bytes_that_never_form_utf8_stream_as_they_come():
    """A run of UTF-8 lead bytes (each a token) never decodes clean: every step's text ends
    in U+FFFD. Only the newest byte may still begin a character, so each earlier one's
    U+FFFD goes out a token later, not all of them when the request ends."""
    tok = tiny_tokenizer()
    lead = _byte_token(tok, 0xE2)
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"))
    pieces = []
    for n in range(1, 41):
        detok.add_token(lead)
        pieces.append(detok.release())
        assert detok.text == "\ufffd" * (n - 1)
    assert detok.read_offset > 30  # decodes stay short: the run's final part was passed
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode([lead] * 40) == "\ufffd" * 40


def test_a_character_split_over_byte_tokens_comes_out_whole_after_invalid_bytes():
    tok = tiny_tokenizer()
    ids = [_byte_token(tok, b) for b in (0xE2, 0xE2, *"🙂".encode(), 0x41)]
    pieces = _stream(IncrementalDetokenizer(tok, []), ids)
    assert "".join(pieces) == tok.decode(ids) == "\ufffd\ufffd🙂A"
    assert "🙂" in pieces and pieces.count("\ufffd") == 2  # never a U+FFFD for a part of 🙂


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(include):
    tok = tiny_tokenizer()
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(
        tok, [], stop_strings=["fox jumps"], include_stop_str_in_output=include
    )
    pieces = _stream(detok, ids)
    assert detok.stopped_on == "fox jumps"
    expected = "The quick brown fox jumps" if include else "The quick brown "
    assert "".join(pieces) == expected
    if not include:
        assert not any("fox" in p for p in pieces)


def test_released_text_never_holds_a_stop_string_prefix_too_long():
    tok = tiny_tokenizer()
    ids = tok.encode("Hello world! How are you today?")
    detok = IncrementalDetokenizer(tok, [], stop_strings=["XYZW"])
    released = ""
    for t in ids:
        detok.add_token(t)
        released += detok.release()
        assert len(detok.text) - len(released) <= 3
    assert released + detok.flush() == tok.decode(ids)
    assert detok.stopped_on is None


def test_earliest_of_several_stop_strings_wins():
    tok = tiny_tokenizer()
    ids = tok.encode("Hello world! How are you today?")
    detok = IncrementalDetokenizer(tok, [], stop_strings=["today", "How"])
    assert "".join(_stream(detok, ids)) == "Hello world! "
    assert detok.stopped_on == "How"


def _tokenizers():
    from atom_core.loader import embedded_model_path
    from atom_core.loader.gguf_loader import GGUFFile

    return [tiny_tokenizer(), GGUFFile(embedded_model_path()).load_tokenizer()]


@pytest.mark.parametrize("skip_special", [True, False])
def test_fast_decoder_equals_tokenizer_decode(skip_special):
    # The Rust-backend shortcut must decode exactly as transformers does, specials included.
    rng = random.Random(1)
    for tok in _tokenizers():
        decode = fast_decoder(tok, skip_special)
        ids_pool = list(range(min(len(tok), 50000)))
        for _ in range(40):
            ids = rng.choices(ids_pool, k=rng.randrange(1, 12))
            assert decode(ids) == tok.decode(ids, skip_special_tokens=skip_special)


def test_fast_decoder_keeps_transformers_cleanup():
    # A tokenizer that post-processes (clean_up_tokenization_spaces) goes through decode().
    tok = tiny_tokenizer()
    calls = []

    class Wrapped:
        backend_tokenizer = tok.backend_tokenizer
        clean_up_tokenization_spaces = True

        def decode(self, ids, skip_special_tokens):
            calls.append(ids)
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    assert fast_decoder(Wrapped(), True)([72, 105]) == tok.decode([72, 105])
    assert calls == [[72, 105]]


def test_request_text_streams_what_the_detokenizer_releases():
    tok = tiny_tokenizer()
    ids = tok.encode("Hello world! How are you today?")
    text = RequestText(tok, [], SamplingParams(stop_strings=["XYZW"]))
    pieces = [text.update([t]) for t in ids[:-1]]
    assert all(reason is None and stop is None for _, reason, stop in pieces)
    last, reason, _ = text.update(ids[-1:], "length")
    assert reason == "length"
    assert "".join(piece for piece, _, _ in pieces) + last == tok.decode(ids)


@pytest.mark.parametrize("stop_reason", [None, 7])  # EOS, a stop token id
def test_the_token_that_stops_a_request_is_not_text(stop_reason):
    tok = tiny_tokenizer()
    ids = tok.encode("Hello world")
    text = RequestText(tok, [], SamplingParams())
    update = text.update([*ids, tok.encode("!")[0]], "stop", stop_reason)
    assert update == (tok.decode(ids), "stop", stop_reason)


def test_a_stop_string_ends_the_request_whatever_the_engine_said():
    tok = tiny_tokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    text = RequestText(tok, [], SamplingParams(stop_strings=["fox"]))
    # The engine ran to its length limit in the same step; the stop string came first.
    assert text.update(ids, "length") == ("The quick brown ", "stop", "fox")


def _byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer: words, and every other byte as a <0xNN> token,
    decoded by tokenizers' ByteFallback (a run of byte tokens that is not all valid UTF-8
    decodes to one U+FFFD per byte)."""
    from tokenizers import Tokenizer, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({piece: 256 + i for i, piece in enumerate(["▁", "o", "k", "▁ok", "ok"])})
    model = BPE(vocab=vocab, merges=[("o", "k"), ("▁", "ok")], byte_fallback=True)
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)


def test_byte_fallback_characters_in_a_row_stream_whole():
    """Consecutive characters spelled in byte tokens decode as one byte run, all U+FFFD
    until its last byte: nothing of it may go out early (the byte-level rule would send
    U+FFFDs that later become the emoji)."""
    tok = _byte_fallback_tokenizer()
    ids = tok.encode("ok 😀😀🙂 ok é", add_special_tokens=False)
    assert sum(i < 256 for i in ids) == 14  # the emoji and é as byte tokens
    pieces = _stream(IncrementalDetokenizer(tok, []), ids)
    assert "".join(pieces) == tok.decode(ids) == "ok 😀😀🙂 ok é"
    assert not any("\ufffd" in piece for piece in pieces)
    lone = [0xE2] * 6  # and bytes that never form UTF-8 still come out whole at the end
    assert "".join(_stream(IncrementalDetokenizer(tok, []), lone)) == "\ufffd" * 6


def test_a_stop_string_in_the_unfinished_last_character_still_stops():
    """A request's last character, unfinished, comes out as U+FFFD when it ends; if that
    completes a stop string, the request ends on it, as the same text would mid-stream."""
    tok = tiny_tokenizer()
    ids = [*tok.encode("Hi"), _byte_token(tok, 0xE2)]
    text = RequestText(tok, [], SamplingParams(stop_strings=["\ufffd"]))
    assert text.update(ids[:-1]) == ("Hi", None, None)
    assert text.update(ids[-1:], "length") == ("", "stop", "\ufffd")


def test_request_text_takes_a_step_of_several_tokens():
    tok = tiny_tokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    one_by_one = RequestText(tok, [], SamplingParams(stop_strings=["lazy"]))
    per_token = "".join(one_by_one.update([t])[0] for t in ids[:-1])
    per_token += one_by_one.update(ids[-1:], "length")[0]
    in_steps = RequestText(tok, [], SamplingParams(stop_strings=["lazy"]))
    stepped = "".join(in_steps.update(ids[i : i + 3])[0] for i in range(0, len(ids), 3))
    assert per_token == stepped == "The quick brown fox jumps over the "
