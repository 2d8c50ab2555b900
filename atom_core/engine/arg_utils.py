"""EngineArgs: the engine's command-line flags, derived from the Config dataclasses."""

from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import MISSING, Field, fields
from typing import TYPE_CHECKING, Any

from atom_core.config import PARTS, Config

if TYPE_CHECKING:
    from atom_core.engine.llm_engine import LLMEngine


def _scalar_type(annotation: str) -> type:
    for name, typ in (("bool", bool), ("int", int), ("float", float)):
        if name in annotation:
            return typ
    return str


def _add_field(group: argparse._ArgumentGroup, f: Any, help_prefix: str = "") -> None:
    meta = f.metadata
    default = f.default_factory() if f.default is MISSING else f.default
    kwargs: dict[str, Any] = {"dest": f.name, "default": default,
                              "help": help_prefix + meta["help"]}
    typ = _scalar_type(str(f.type))
    if meta.get("boolean_optional"):
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typ is bool:
        kwargs["action"] = "store_true"
    else:
        kwargs["type"] = typ
        for key in ("choices", "nargs", "const"):
            if key in meta:
                kwargs[key] = meta[key]
    group.add_argument(*meta["flags"], **kwargs)


def _field(name: str) -> Field:
    for dc in PARTS.values():
        for f in fields(dc):
            if f.name == name:
                return f
    raise KeyError(name)


class EngineArgs:
    """Engine options by flat field name; ``LLMEngine(**kwargs)`` takes the same names."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser, exclude: Collection[str] = ()
    ) -> argparse.ArgumentParser:
        """One argument group per Config part; the fields named in ``exclude`` are left
        to the caller (``add_cli_arg``)."""
        for part, dc in PARTS.items():
            group = parser.add_argument_group(part.replace("_", " "))
            for f in fields(dc):
                if f.name not in exclude:
                    _add_field(group, f)
        return parser

    @staticmethod
    def add_cli_arg(group: argparse._ArgumentGroup, name: str, help_prefix: str = "") -> None:
        """The flag of field ``name`` in a group of the caller's: ``atom serve`` shows the
        engine's ``--port`` beside its own ``--server-port``."""
        _add_field(group, _field(name), help_prefix)

    @staticmethod
    def field_names() -> list[str]:
        return [f.name for dc in PARTS.values() for f in fields(dc)]

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{name: getattr(args, name)
                      for name in cls.field_names() if hasattr(args, name)})

    def create_config(self) -> Config:
        return Config.from_kwargs(**self.kwargs)

    def create_engine(self) -> LLMEngine:
        from atom_core.engine.llm_engine import LLMEngine

        return LLMEngine(config=self.create_config())
