"""``--model`` as a Hugging Face Hub repo id (``Qwen/Qwen3-8B``): resolved to a local
snapshot directory through huggingface_hub, its cache (``$HF_HOME``, ``$HF_HUB_CACHE``, or
``--download-dir``) and its offline switch (``HF_HUB_OFFLINE=1``: the cache only). The
weights are fetched as safetensors only (no pickled ``.bin``), with the configs, tokenizer
files and chat template; huggingface_hub shows a progress bar while it downloads.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from atom_core.errors import ConfigError

logger = logging.getLogger(__name__)

# What a model directory needs: weights as safetensors, and every small file beside them.
ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "*.jinja", "*.txt",
                  "*.model", "*.tiktoken", "tokenizer*"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(model: str) -> bool:
    """Whether ``model`` reads as ``owner/name`` and names nothing on this machine."""
    return bool(_REPO_ID.match(model)) and not Path(model).expanduser().exists()


def resolve_model(model: str | None, revision: str | None = None,
                  download_dir: str | None = None) -> str | None:
    """``model`` itself, or for a Hub repo id the local directory of its snapshot
    (downloaded unless cached, or the cache alone when offline)."""
    if model is None or not is_repo_id(model):
        if revision is not None:
            raise ConfigError("--revision applies to a Hugging Face repo id, not to a local "
                              f"--model ({model or 'the embedded default'})")
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 allow_patterns=ALLOW_PATTERNS)
    except LocalEntryNotFoundError:
        raise ConfigError(f"--model {model}: not in the Hugging Face cache"
                          f"{f' ({download_dir})' if download_dir else ''} and the Hub cannot "
                          "be reached (HF_HUB_OFFLINE, or no network)") from None
    except GatedRepoError:
        raise ConfigError(f"--model {model} is gated: accept its terms on the Hub and log in "
                          "(HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ConfigError(f"--model {model} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"--model {model}: no such repository on the Hugging Face Hub "
                          "(or it is private: log in with HF_TOKEN)") from None
    logger.info("--model %s%s: %s", model, f"@{revision}" if revision else "", path)
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"--model {model} has no config.json: not a transformers checkpoint")
    return path
