"""Typed registries filled by the plugin hooks, and the rules for choosing from them.

Each hook in hookspecs.py names the registry its ``register`` calls fill; a registry's
``register`` method is what a plugin's ``register(...)`` call reaches (after the plugin
manager adds the distribution's name).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from atom_core.errors import PluginConflictError, UnsupportedError

DEVICE_KINDS = ("cpu", "cuda", "hip")


class Registry(Protocol):
    def register(self, name: str, obj: Any, dist: str, **options: Any) -> str:
        """Add what ``dist`` passed to ``register(name, obj, **options)``; return the label
        ``atom plugins`` lists it under. Raises PluginConflictError on a clash."""
        ...


@dataclass(frozen=True)
class ExtensionPoint:
    """A hook and the registry it fills, declared together on its spec in hookspecs.py."""

    hook: str
    attribute: str  # the registry's attribute on Registries
    new_registry: Callable[[], Registry]


@dataclass(frozen=True)
class Entry:
    """One named thing a distribution registered."""

    name: str
    obj: Any
    dist: str


class NamedRegistry:
    """Name -> object; a second distribution using a taken name is a start-up error."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, obj: Any, dist: str) -> str:
        prev = self._entries.get(name)
        if prev is not None:
            raise PluginConflictError(
                f"{self.what} {name!r} is registered twice: by {prev.dist} and by {dist}. "
                f"Uninstall one, or limit loading with ATOM_PLUGINS."
            )
        self._entries[name] = Entry(name, obj, dist)
        return name

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

    def register(
        self, name: str, fn: Callable[..., Any], dist: str, *, provider: str,
        device_kinds: str | Sequence[str] = DEVICE_KINDS, priority: int = 0,
    ) -> str:
        self.add(OpImpl(name, fn, provider, as_device_kinds(device_kinds), priority, dist))
        return f"{name}[{provider}]"

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

    def register(
        self, name: str, cls: type, dist: str, *, device_kinds: str | Sequence[str] = DEVICE_KINDS,
        kind: str = "mha", priority: int = 0,
    ) -> str:
        kinds = as_device_kinds(device_kinds)
        self.add(AttentionBackendInfo(name, cls, kinds, kind, priority, dist))
        return name

    def add(self, info: AttentionBackendInfo) -> None:
        if info.kind not in ("mha", "mla"):
            raise PluginConflictError(
                f"{info.dist}: attention backend {info.name!r} has kind {info.kind!r}; "
                "expected 'mha' or 'mla'"
            )
        prev = self.backends.get(info.name)
        if prev is not None:
            raise PluginConflictError(
                f"attention backend {info.name!r} is registered twice: "
                f"by {prev.dist} and by {info.dist}"
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


class Registries:
    """Everything the installed plugins registered, built once per process: one registry per
    hook, as the attribute its spec names (``registries.ops``) and in ``by_hook``."""

    # For readers and type checkers: the core's hooks. The attributes come from hookspecs.py.
    architectures: NamedRegistry
    ops: OpRegistry
    attention_backends: AttentionBackendRegistry
    proposers: NamedRegistry
    tool_formats: NamedRegistry
    reasoning_dialects: NamedRegistry

    def __init__(self, points: Iterable[ExtensionPoint]) -> None:
        self.by_hook: dict[str, Registry] = {}
        for point in points:
            registry = point.new_registry()
            setattr(self, point.attribute, registry)
            self.by_hook[point.hook] = registry


def as_device_kinds(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)
