"""The defaults for what a request leaves out: the model's recommended sampling
(``--generation-config``, as vLLM has it).

A request that sets none of temperature, top_p, top_k, min_p, repetition_penalty or
max_tokens gets the model's values for them from its ``generation_config.json``
(``max_new_tokens`` becomes max_tokens); what the request sets wins, field by field, and what
the file leaves out keeps the API's default (temperature 1, top_p 1, top_k and min_p off,
repetition_penalty 1, max_tokens 256). A field sent as ``null`` counts as left out, except
max_tokens, where null means "as many as fit".

One resolution and one merge (``GenerationDefaults.resolve`` and ``apply``) serve the
server's routes, ``LLMEngine.get_default_sampling_params`` (what ``generate`` and
``add_request`` use when given no SamplingParams) and the ``atom generate`` / ``atom chat``
flags, whose own defaults (greedy, 128 tokens) take the API's place.

``--generation-config``:

- ``auto`` (the default): the model directory's generation_config.json. The embedded model
  (SmolLM2-135M-Instruct, a GGUF) ships none, and at temperature 1 a 135M model strays
  into nonsense within a sentence, so it gets ``EMBEDDED_DEFAULTS``: the sampling its model
  card recommends (HuggingFaceTB/SmolLM2-135M-Instruct, "How to use":
  ``temperature=0.2, top_p=0.9``; its generation_config.json names only token ids).
  Any other model without a generation_config.json keeps the API's defaults.
- ``none``, or ``vllm`` (vLLM's name for it): the API's defaults, whatever the model ships.
- a folder: the generation_config.json in it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Set
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from atom_core.errors import AtomError, ConfigError
from atom_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

NO_DEFAULTS = ("none", "vllm")
FILE_NAME = "generation_config.json"
# generation_config.json's keys -> the SamplingParams field each sets, and its type.
FIELDS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}
EMBEDDED_DEFAULTS: dict[str, float | int] = {"temperature": 0.2, "top_p": 0.9}
_MAX_TOKENS_FIELDS = frozenset({"max_tokens", "max_completion_tokens"})


@dataclass(frozen=True)
class GenerationDefaults:
    """SamplingParams field -> the value a request gets when it does not set that field;
    ``source`` says where the values came from (the start-up log line)."""

    values: Mapping[str, float | int] = field(default_factory=dict)
    source: str = "the API's defaults"

    @classmethod
    def resolve(cls, setting: str, model: str | None) -> GenerationDefaults:
        """The defaults ``--generation-config setting`` gives the model ``model`` (a local
        path, or None for the embedded one). ConfigError for a file that is not a valid
        generation config."""
        if setting in NO_DEFAULTS:
            return cls(source=f"the API's defaults (--generation-config {setting})")
        if setting != "auto":
            return cls(read_generation_config(Path(setting).expanduser() / FILE_NAME),
                       f"{Path(setting) / FILE_NAME} (--generation-config)")
        if _is_embedded(model):
            return cls(EMBEDDED_DEFAULTS, "the embedded SmolLM2-135M-Instruct's model card")
        path = Path(model).expanduser() if model is not None else None
        if path is not None and path.is_dir() and (path / FILE_NAME).is_file():
            return cls(read_generation_config(path / FILE_NAME), str(path / FILE_NAME))
        return cls(source=f"the API's defaults (the model has no {FILE_NAME})")

    def apply(self, params: SamplingParams, given: Set[str]) -> SamplingParams:
        """``params`` with the defaults in every field the request did not set; ``given``
        is the request's fields set (pydantic's ``model_fields_set``)."""
        out = {k: v for k, v in self.values.items() if k != "max_tokens" and k not in given}
        if "max_tokens" in self.values and not given & _MAX_TOKENS_FIELDS:
            out["max_tokens"] = self.values["max_tokens"]
        return replace(params, **out) if out else params

    def describe(self) -> str:
        shown = " ".join(f"{k}={v:g}" for k, v in self.values.items()) or "none"
        return f"{shown} (from {self.source})"


def check_setting(setting: str) -> None:
    """ConfigError unless ``setting`` is auto, none, vllm, or a folder holding a valid
    generation_config.json (Config.validate: a wrong one fails before anything loads)."""
    if setting != "auto" and setting not in NO_DEFAULTS:
        GenerationDefaults.resolve(setting, None)


def read_generation_config(path: Path) -> dict[str, float | int]:
    """The request defaults ``path`` sets, checked as a request's would be."""
    if not path.is_file():
        where = path.parent
        raise ConfigError(f"--generation-config {where}: no {FILE_NAME} there" if where.is_dir()
                          else f"--generation-config {where}: no such folder (auto, none, vllm "
                          "or a folder holding a generation_config.json)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object")
    values: dict[str, float | int] = {}
    for key, (name, typ) in FIELDS.items():
        value: Any = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or (
            typ is int and not float(value).is_integer()
        ):
            raise ConfigError(f"{path}: {key} must be a number{' (an integer)' * (typ is int)}, "
                              f"got {value!r}")
        values[name] = typ(value)
    try:
        SamplingParams(**values).validate()
    except AtomError as exc:
        raise ConfigError(f"{path}: {exc} (--generation-config none ignores the file)") from None
    return values


def _is_embedded(model: str | None) -> bool:
    """No --model, or --model naming the embedded GGUF file itself."""
    if model is None:
        return True
    if not model.endswith(".gguf"):
        return False
    from atom_core.loader import embedded_model_path

    try:
        return Path(model).expanduser().resolve() == embedded_model_path().resolve()
    except ConfigError:  # the embedded model is not installed
        return False
