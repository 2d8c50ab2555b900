"""The benchmark's tokenizer: transformers' AutoTokenizer on a local path (no network)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def get_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """AutoTokenizer for a model directory, a tokenizer directory or a ``.gguf`` file.

    Only local files are read: a benchmark that silently downloads a tokenizer measures
    the wrong thing when the download picks another revision than the server's.
    """
    from transformers import AutoTokenizer

    path = Path(name_or_path).expanduser()
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer GGUF file {path} does not exist")
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    if not path.exists() and os.sep not in name_or_path and "/" not in name_or_path:
        raise FileNotFoundError(
            f"tokenizer {name_or_path!r} is not a local path (pass --tokenizer DIR)")
    return AutoTokenizer.from_pretrained(str(path) if path.exists() else name_or_path, **kwargs)
