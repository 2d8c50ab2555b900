"""The GGUF header cache: a load served from an entry gives what parsing the file gives,
and an entry that does not match its file is never used."""

from __future__ import annotations

import logging
import shutil

import msgspec
import numpy as np
import pytest

from atom_core.errors import ConfigError
from atom_core.loader import embedded_model_path, gguf_cache
from atom_core.loader.gguf_loader import GGUFFile

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world <|im_start|>user\nhi<|im_end|>",
    "naïve café 日本語 🙂",
    "  spaces\t\ttabs\n\n",
    "<|endoftext|>",
]


class Parsed(Exception):
    """Raised by a stand-in for the parser: the load did not come from the entry."""


def refuse_parse(path, check):
    raise Parsed(path)


READERS_MADE: list[str] = []  # paths the first parse built a gguf.GGUFReader for


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """(the embedded file, its cache root, a GGUFFile from a parse, one from the entry)."""
    import gguf

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            READERS_MADE.append(str(path))
            super().__init__(path, *args, **kwargs)

    root = tmp_path_factory.mktemp("atom-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATOM_CACHE_DIR", str(root))
        path = embedded_model_path()
        mp.setattr(gguf, "GGUFReader", CountingReader)
        parsed = GGUFFile(path)
        mp.undo()
        mp.setenv("ATOM_CACHE_DIR", str(root))
        mp.setattr(gguf_cache, "_parse", refuse_parse)
        from_entry = GGUFFile(path)
    return path, root, parsed, from_entry


@pytest.fixture
def cache_env(cached, monkeypatch, tmp_path):
    """A copy of the module's cache root for a test to damage; the parser refuses."""
    path, root, _, _ = cached
    mine = tmp_path / "cache"
    shutil.copytree(root, mine)
    monkeypatch.setenv("ATOM_CACHE_DIR", str(mine))
    monkeypatch.setattr(gguf_cache, "_parse", refuse_parse)
    (entry,) = (mine / "gguf").iterdir()
    return path, entry


def test_first_load_writes_one_entry(cached):
    _, root, _, _ = cached
    (entry,) = (root / "gguf").iterdir()
    assert sorted(p.name for p in entry.iterdir()) == ["config", "index.json", "tokenizer"]


def test_the_entry_gives_what_the_parse_gives(cached):
    path, _, parsed, from_entry = cached
    assert from_entry.header.index == parsed.header.index
    assert from_entry.load_config().to_dict() == parsed.load_config().to_dict()
    assert from_entry.chat_template() == parsed.chat_template() is not None
    a, b = parsed.load_tokenizer(), from_entry.load_tokenizer()
    assert [a(t)["input_ids"] for t in TEXTS] == [b(t)["input_ids"] for t in TEXTS]
    assert a.decode(list(range(400))) == b.decode(list(range(400)))
    assert ((a.bos_token_id, a.eos_token_id, a.pad_token_id)
            == (b.bos_token_id, b.eos_token_id, b.pad_token_id))
    assert a.added_tokens_decoder == b.added_tokens_decoder and len(a) == len(b)


def test_a_first_load_reads_the_header_once(cached):
    """ATOM's reader, then transformers' config and tokenizer, from one gguf.GGUFReader."""
    path, _, _, _ = cached
    assert READERS_MADE == [str(path)]


def test_the_parse_gives_what_transformers_gives_on_its_own(cached):
    """The config and tokenizer built through the shared reader equal transformers' own
    loads of the file, each with a reader of its own."""
    from transformers import AutoConfig, AutoTokenizer

    path, _, parsed, _ = cached
    ours = parsed.load_config().to_dict()
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    assert theirs.pop("architectures") is None  # load_config names ATOM's model class
    assert ours.pop("architectures") == ["LlamaForCausalLM"] and ours == theirs
    a = parsed.load_tokenizer()
    b = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert [a(t)["input_ids"] for t in TEXTS] == [b(t)["input_ids"] for t in TEXTS]
    assert a.decode(list(range(400))) == b.decode(list(range(400)))
    assert a.added_tokens_decoder == b.added_tokens_decoder and len(a) == len(b)


def test_other_files_get_a_reader_of_their_own(tmp_path):
    import gguf

    made = []
    shared = object()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", lambda p, *a, **k: made.append((str(p), a, k)) or "fresh")
        with gguf_cache.parsed_once(shared, embedded_model_path()):
            assert gguf.GGUFReader(str(embedded_model_path())) is shared
            assert gguf.GGUFReader(tmp_path / "other.gguf") == "fresh"
            assert gguf.GGUFReader(str(embedded_model_path()), "r+") == "fresh"
        assert gguf.GGUFReader(str(embedded_model_path())) == "fresh"  # restored on exit
    assert made == [(str(tmp_path / "other.gguf"), (), {}),
                    (str(embedded_model_path()), ("r+",), {}),
                    (str(embedded_model_path()), (), {})]


def test_tensor_views_are_the_readers(cached):
    from gguf import GGUFReader

    path, _, _, from_entry = cached
    reader = GGUFReader(str(path))
    views = gguf_cache.tensor_views(path, from_entry.header.index)
    assert [t.name for t, _ in views] == [t.name for t in reader.tensors]
    for (entry, view), theirs in zip(views, reader.tensors):
        assert entry.tensor_type == int(theirs.tensor_type)
        assert view.dtype == theirs.data.dtype and view.shape == theirs.data.shape
        assert np.array_equal(view, theirs.data), entry.name


def test_a_changed_header_is_parsed_again(cache_env):
    path, entry = cache_env
    index = msgspec.json.decode((entry / "index.json").read_bytes(), type=gguf_cache.Index)
    stale = msgspec.structs.replace(index, header_digest="0" * 32)
    (entry / "index.json").write_bytes(msgspec.json.encode(stale))
    with pytest.raises(Parsed):
        GGUFFile(path)


def test_an_unreadable_entry_is_parsed_again_with_a_warning(cache_env, caplog):
    path, entry = cache_env
    (entry / "index.json").write_bytes(b"{not json")
    with caplog.at_level(logging.WARNING), pytest.raises(Parsed):
        GGUFFile(path)
    assert "unreadable" in caplog.text


def test_the_architecture_is_checked_on_a_cached_load(cache_env):
    path, entry = cache_env
    index = msgspec.json.decode((entry / "index.json").read_bytes(), type=gguf_cache.Index)
    other = msgspec.structs.replace(index, architecture="qwen2")
    (entry / "index.json").write_bytes(msgspec.json.encode(other))
    with pytest.raises(ConfigError, match="architecture 'qwen2' is not supported"):
        GGUFFile(path)


def test_an_unwritable_cache_still_loads(cached, monkeypatch, tmp_path, caplog):
    path, _, parsed, _ = cached
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ATOM_CACHE_DIR", str(blocker))
    monkeypatch.setattr(gguf_cache, "_parse", lambda p, check: parsed.header)
    with caplog.at_level(logging.WARNING):
        got = GGUFFile(path)
    assert got.header is parsed.header
    assert "not writable" in caplog.text


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path / "a"))
    assert gguf_cache.cache_root() == tmp_path / "a"
    monkeypatch.delenv("ATOM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache.cache_root() == tmp_path / "xdg" / "atom"


def test_a_tokenizer_gguf_is_read_without_the_cache(cached, monkeypatch, tmp_path):
    # --tokenizer FILE.gguf needs only the tokenizer, of whatever architecture: no entry.
    from atom_core.config import Config
    from atom_core.loader import load_tokenizer
    from atom_core.testing.tiny_models import tiny_model_dir

    path, _, parsed, _ = cached
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path / "unused"))
    config = Config.from_kwargs(model=str(tiny_model_dir("llama")), tokenizer=str(path))
    tokenizer, _ = load_tokenizer(config)
    from_entry = parsed.load_tokenizer()
    assert [tokenizer(t)["input_ids"] for t in TEXTS] == [from_entry(t)["input_ids"] for t in TEXTS]
    assert not (tmp_path / "unused").exists()
