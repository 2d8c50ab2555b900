"""What a GGUF file's header yields, kept on disk so that only a file's first load parses it.

The header (every metadata key, then every tensor's name, type, shape and offset) is the
slow part of opening a GGUF: the ``gguf`` package reads the tokenizer's vocabulary and
merges one string at a time, ~6 s for SmolLM2's 49k tokens on a 2-core VM, and
transformers parses the header again for the config and again for the tokenizer (a first
parse hands it the reader instead: ``parsed_once``). A server's start parsed it five times
(the engine three, the frontend two).

An entry is a directory under ``<cache root>/gguf/``: the config and tokenizer as
transformers saves them (``save_pretrained``), and an index (msgspec JSON) of the
architecture, the chat template and each tensor's place in the file. Tensor data is not
copied: later loads map the file and view each tensor where the index says it lies, with
the dtype and shape the ``gguf`` reader gave it.

The entry's name hashes the file size and its first ``PREFIX_BYTES`` (with this format's
version and transformers'); the index also holds a hash of the whole header (the bytes
before the tensor data), checked on every load, so a file whose header changed is parsed
again, never read through a stale entry. The cache root is ``$ATOM_CACHE_DIR``, else
``$XDG_CACHE_HOME/atom``, else ``~/.cache/atom``. An unwritable root costs only the speed-up
(a warning says so).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import transformers
import xxhash
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when an entry's layout changes
PREFIX_BYTES = 1 << 20


class TensorEntry(msgspec.Struct, frozen=True):
    name: str
    tensor_type: int  # gguf.GGMLQuantizationType
    offset: int  # absolute, in bytes
    nbytes: int
    dtype: str  # numpy dtype string, byte order included ("<f4", "|u1")
    shape: list[int]  # as the gguf reader shapes it (quantized types: rows x bytes)


class Index(msgspec.Struct, frozen=True):
    data_offset: int  # where tensor data starts: the header is every byte before it
    header_digest: str
    architecture: str | None
    chat_template: str | None
    tensors: list[TensorEntry]


@dataclass
class Header:
    """A GGUF file's header, parsed or read back from the cache."""

    index: Index
    config: PretrainedConfig
    tokenizer: Any


def cache_root() -> Path:
    if os.environ.get("ATOM_CACHE_DIR"):
        return Path(os.environ["ATOM_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "atom"


def _entry_dir(path: Path) -> Path:
    h = xxhash.xxh3_128()
    h.update(f"atom-gguf-{FORMAT}-transformers-{transformers.__version__}-{path.stat().st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(PREFIX_BYTES))
    return cache_root() / "gguf" / h.hexdigest()


def _header_digest(path: Path, data_offset: int) -> str:
    with open(path, "rb") as f:  # a header is a few MB: one read
        return xxhash.xxh3_128_hexdigest(f.read(data_offset))


def tensor_views(path: Path, index: Index) -> list[tuple[TensorEntry, np.ndarray]]:
    """Each tensor's bytes in the mapped file, viewed as the gguf reader views them."""
    data = np.asarray(np.memmap(path, mode="r"))  # a plain array maps the same pages, views faster
    return [
        (t, data[t.offset : t.offset + t.nbytes].view(np.dtype(t.dtype)).reshape(t.shape))
        for t in index.tensors
    ]


def read_header(path: Path, check: Callable[[Index], None] = lambda index: None) -> Header:
    """The header of ``path``: from its cache entry when one matches, else parsed (and the
    entry written). ``check`` sees the index before transformers reads the file, and raises
    to refuse it (an architecture the caller cannot load)."""
    entry = _entry_dir(path)
    cached, stale = _read_entry(path, entry)
    if cached is not None:
        check(cached.index)
        return cached
    header = _parse(path, check)
    _write_entry(entry, header, replace=stale)
    return header


def _read_entry(path: Path, entry: Path) -> tuple[Header | None, bool]:
    """(the entry's header, or None; whether an entry exists that does not match)."""
    index_file = entry / "index.json"
    if not index_file.is_file():
        return None, False
    try:
        index = msgspec.json.decode(index_file.read_bytes(), type=Index)
        if _header_digest(path, index.data_offset) != index.header_digest:
            logger.info("%s: its header changed since it was cached; parsing it again", path)
            return None, True
        config = AutoConfig.from_pretrained(entry / "config")
        tokenizer = AutoTokenizer.from_pretrained(entry / "tokenizer")
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        logger.warning("GGUF cache entry %s is unreadable (%s); parsing %s again", entry, exc, path)
        return None, True
    config.name_or_path = str(path.parent)  # as loading from the file names it
    return Header(index, config, tokenizer), False


def _parse(path: Path, check: Callable[[Index], None]) -> Header:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def text(key: str) -> str | None:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    index = Index(
        data_offset=reader.data_offset,
        header_digest=_header_digest(path, reader.data_offset),
        architecture=text("general.architecture"),
        chat_template=text("tokenizer.chat_template"),
        tensors=[
            TensorEntry(t.name, int(t.tensor_type), int(t.data_offset), int(t.data.nbytes),
                        t.data.dtype.str, list(t.data.shape))
            for t in reader.tensors
        ],
    )
    check(index)
    with parsed_once(reader, path):
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Header(index, config, tokenizer)


@contextmanager
def parsed_once(reader: Any, path: Path) -> Iterator[None]:
    """While transformers builds the config and tokenizer of ``path``, every
    ``gguf.GGUFReader(path)`` it makes is ``reader``, already parsed.

    transformers' GGUF loader makes a reader per call (the config; the tokenizer, which
    loads the config too), each reading the vocabulary again: the config and tokenizer took
    6.3 + 8.7 s on a 2-core VM, 1.2 s for the config with the reader handed over. Other
    files, and calls with other arguments, get a reader of their own. Should a transformers
    release stop calling ``gguf.GGUFReader`` at load time, this only stops saving the time.
    """
    import gguf

    make = gguf.GGUFReader
    target = os.path.realpath(path)

    def reader_for(p: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and os.path.realpath(p) == target:
            return reader
        return make(p, *args, **kwargs)

    gguf.GGUFReader = reader_for
    try:
        yield
    finally:
        gguf.GGUFReader = make


def _write_entry(entry: Path, header: Header, *, replace: bool) -> None:
    """Written in a scratch directory and renamed into place, so a reader never sees half an
    entry; of two processes writing the same entry (a server's engine and frontend on a
    first start) the first rename wins. ``replace``: the entry there is stale; remove it."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    except OSError as exc:
        logger.warning("GGUF cache %s is not writable (%s): each load will parse the header",
                       entry.parent, exc)
        return
    try:
        header.config.save_pretrained(scratch / "config")
        header.tokenizer.save_pretrained(scratch / "tokenizer")
        (scratch / "index.json").write_bytes(msgspec.json.encode(header.index))
        if replace:
            shutil.rmtree(entry, ignore_errors=True)
        os.rename(scratch, entry)
    except OSError as exc:
        if not (entry / "index.json").is_file():  # else another process wrote it first
            logger.warning("could not write GGUF cache entry %s (%s)", entry, exc)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
