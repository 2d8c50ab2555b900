"""Typed registries filled by the plugin hooks, and the rules for choosing from them."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from atom_core.errors import PluginConflictError, UnsupportedError

DEVICE_KINDS = ("cpu", "cuda", "hip")


@dataclass(frozen=True)
class Entry:
    """One named thing a distribution registered."""

    name: str
    obj: Any
    dist: str


class NamedRegistry:
    """Name -> object; a second distribution using a taken name is a start-up error."""

    def __init__(self, hook: str, what: str) -> None:
        self.hook = hook
        self.what = what
        self._entries: dict[str, Entry] = {}

    def add(self, name: str, obj: Any, dist: str) -> None:
        if not isinstance(name, str) or not name:
            raise PluginConflictError(f"{dist}: {self.hook} needs a non-empty string name, got {name!r}")
        prev = self._entries.get(name)
        if prev is not None:
            raise PluginConflictError(
                f"{self.what} {name!r} is registered twice: by {prev.dist} and by {dist}. "
                f"Uninstall one, or limit loading with ATOM_PLUGINS."
            )
        self._entries[name] = Entry(name, obj, dist)

    def get(self, name: str) -> Any:
        try:
            return self._entries[name].obj
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "none"
            raise UnsupportedError(f"unknown {self.what} {name!r}; known: {known}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())


@dataclass(frozen=True)
class OpImpl:
    op: str
    fn: Callable[..., Any]
    provider: str
    device_kinds: tuple[str, ...]
    priority: int
    dist: str


@dataclass
class OpRegistry:
    """Op name -> implementations; the best one for a device is chosen per op."""

    impls: dict[str, list[OpImpl]] = field(default_factory=dict)

    def add(self, impl: OpImpl) -> None:
        bad = [k for k in impl.device_kinds if k not in DEVICE_KINDS]
        if bad or not impl.device_kinds:
            raise PluginConflictError(
                f"{impl.dist}: op {impl.op!r} has device kinds {impl.device_kinds}; "
                f"each must be one of {DEVICE_KINDS}"
            )
        for other in self.impls.get(impl.op, []):
            if other.provider == impl.provider:
                raise PluginConflictError(
                    f"op {impl.op!r} of provider {impl.provider!r} is registered twice: "
                    f"by {other.dist} and by {impl.dist}"
                )
        self.impls.setdefault(impl.op, []).append(impl)

    def candidates(self, op: str, device_kind: str) -> list[OpImpl]:
        found = [i for i in self.impls.get(op, []) if device_kind in i.device_kinds]
        return sorted(found, key=lambda i: -i.priority)

    def resolve(self, op: str, device_kind: str, provider: str | None = None) -> OpImpl:
        """The implementation of ``op`` to use on ``device_kind``.

        ``provider`` (default: the ATOM_OPS_PROVIDER environment variable) forces one
        provider; it is an error if that provider has no implementation for this device.
        """
        provider = provider if provider is not None else os.environ.get("ATOM_OPS_PROVIDER") or None
        found = self.candidates(op, device_kind)
        if provider is not None:
            found = [i for i in found if i.provider == provider]
        if not found:
            have = sorted(
                f"{i.provider}({','.join(i.device_kinds)})" for i in self.impls.get(op, [])
            )
            forced = f" with ATOM_OPS_PROVIDER={provider}" if provider else ""
            raise UnsupportedError(
                f"no implementation of op {op!r} for device {device_kind!r}{forced}; "
                f"registered: {', '.join(have) or 'none'}"
            )
        return found[0]

    def names(self) -> list[str]:
        return sorted(self.impls)


@dataclass(frozen=True)
class AttentionBackendInfo:
    name: str
    cls: type
    device_kinds: tuple[str, ...]
    kind: str
    priority: int
    dist: str


@dataclass
class AttentionBackendRegistry:
    backends: dict[str, AttentionBackendInfo] = field(default_factory=dict)

    def add(self, info: AttentionBackendInfo) -> None:
        if info.kind not in ("mha", "mla"):
            raise PluginConflictError(
                f"{info.dist}: attention backend {info.name!r} has kind {info.kind!r}; "
                "expected 'mha' or 'mla'"
            )
        prev = self.backends.get(info.name)
        if prev is not None:
            raise PluginConflictError(
                f"attention backend {info.name!r} is registered twice: by {prev.dist} and by {info.dist}"
            )
        self.backends[info.name] = info

    def resolve(self, kind: str, device_kind: str, name: str | None = None) -> AttentionBackendInfo:
        if name is not None:
            info = self.backends.get(name)
            if info is None or device_kind not in info.device_kinds or info.kind != kind:
                raise UnsupportedError(
                    f"attention backend {name!r} cannot serve kind {kind!r} on {device_kind!r}; "
                    f"registered: {', '.join(sorted(self.backends)) or 'none'}"
                )
            return info
        found = [
            b for b in self.backends.values() if b.kind == kind and device_kind in b.device_kinds
        ]
        if not found:
            raise UnsupportedError(f"no {kind} attention backend supports device {device_kind!r}")
        return max(found, key=lambda b: b.priority)

    def names(self) -> list[str]:
        return sorted(self.backends)


@dataclass
class Registries:
    """Everything the installed plugins registered, built once per process."""

    architectures: NamedRegistry = field(
        default_factory=lambda: NamedRegistry("register_model_architectures", "model architecture")
    )
    ops: OpRegistry = field(default_factory=OpRegistry)
    attention_backends: AttentionBackendRegistry = field(default_factory=AttentionBackendRegistry)
    proposers: NamedRegistry = field(
        default_factory=lambda: NamedRegistry("register_spec_decode_proposers", "spec-decode method")
    )
    tool_formats: NamedRegistry = field(
        default_factory=lambda: NamedRegistry("register_tool_formats", "tool-call format")
    )
    reasoning_dialects: NamedRegistry = field(
        default_factory=lambda: NamedRegistry("register_reasoning_dialects", "reasoning dialect")
    )


def as_device_kinds(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)
