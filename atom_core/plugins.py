"""The plugin manager: loads built-in defaults and installed plugins, fills the registries.

Installed plugins are found through the ``atom`` entry-point group. ``ATOM_PLUGINS``
limits which distributions load (comma-separated names; an empty string loads none);
the core's built-in defaults always load, through the same hooks as everyone else.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from atom_core import hookspecs
from atom_core.errors import AtomError, PluginConflictError
from atom_core.registries import ExtensionPoint, Registries

logger = logging.getLogger(__name__)

CORE_DIST = "atom-core"
ENTRY_POINT_GROUP = "atom"

# The core's own implementations, registered like any plugin (datasette's DEFAULT_PLUGINS).
DEFAULT_PLUGINS: tuple[str, ...] = (
    "atom_core.ops.native.plugin",
    "atom_core.layers.attention.plugin",
    "atom_core.spec_decode.plugin",
)


@dataclass
class PluginReport:
    """What one distribution did at start-up, as ``atom plugins`` shows it."""

    name: str
    version: str
    registered: dict[str, list[str]] = field(default_factory=dict)
    declined: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "registered": {k: sorted(v) for k, v in self.registered.items()},
            "declined": self.declined,
        }


class Registrar:
    """The ``register`` callable one distribution gets for one hook."""

    def __init__(self, hook: str, report: PluginReport, add: Callable[..., str]) -> None:
        self._hook = hook
        self._report = report
        self._add = add

    def __call__(self, name: str, obj: Any, **options: Any) -> None:
        if not isinstance(name, str) or not name:
            raise PluginConflictError(
                f"{self._report.name}: {self._hook} needs a non-empty string name, got {name!r}"
            )
        registered_as = self._add(name, obj, self._report.name, **options)
        self._report.registered.setdefault(self._hook, []).append(registered_as)

    def decline(self, reason: str) -> None:
        """Record why this plugin registers nothing on this machine (one line)."""
        reason = " ".join(str(reason).split())
        if self._report.declined is None:
            self._report.declined = reason
            logger.info("plugin %s declined: %s", self._report.name, reason)


def canonical_name(name: str) -> str:
    """PEP 503 normalisation, so ``atom_models_llama`` and ``atom-models-llama`` agree."""
    return re.sub(r"[-_.]+", "-", name).lower()


def allowed_distributions() -> set[str] | None:
    """The distributions ATOM_PLUGINS allows; None when it is unset (all load)."""
    raw = os.environ.get("ATOM_PLUGINS")
    if raw is None:
        return None
    return {canonical_name(p.strip()) for p in raw.split(",") if p.strip()}


def extension_points(specs: ModuleType = hookspecs) -> list[ExtensionPoint]:
    """The hooks ``specs`` declares with ``@extension_point``, in the order declared (the
    order they are called in)."""
    points = []
    for name, obj in vars(specs).items():
        point = getattr(obj, "atom_extension_point", None)
        if isinstance(point, ExtensionPoint):
            points.append(point)
        elif getattr(obj, f"{hookspecs.hookspec.project_name}_spec", None) is not None:
            raise TypeError(f"hook {name} has no registry: declare it with @extension_point")
    return points


@dataclass
class PluginState:
    manager: pluggy.PluginManager
    registries: Registries
    reports: list[PluginReport]


def _load_installed(
    pm: pluggy.PluginManager, owners: dict[str, PluginReport], reports: list[PluginReport]
) -> None:
    allowed = allowed_distributions()
    seen: set[str] = set()
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.value):
        dist = ep.dist
        dist_name = canonical_name(dist.name) if dist is not None else f"<unknown:{ep.value}>"
        seen.add(dist_name)
        if allowed is not None and dist_name not in allowed:
            continue
        report = next((r for r in reports if r.name == dist_name), None)
        if report is None:
            report = PluginReport(dist_name, dist.version if dist is not None else "?")
            reports.append(report)
        try:
            module = ep.load()
        except Exception as exc:  # a broken install must not take the server down
            report.declined = f"failed to import {ep.value}: {type(exc).__name__}: {exc}"
            logger.warning("plugin %s: %s", dist_name, report.declined)
            continue
        plugin_name = f"{dist_name}:{ep.name}"
        pm.register(module, name=plugin_name)
        owners[plugin_name] = report
    if allowed is not None:
        for missing in sorted(allowed - seen):
            logger.warning("ATOM_PLUGINS names %r, which is not installed", missing)


def build_plugin_state() -> PluginState:
    """Load every plugin and call every hook once; raises PluginConflictError on clashes."""
    pm = pluggy.PluginManager("atom")
    pm.add_hookspecs(hookspecs)
    core = PluginReport(CORE_DIST, _version(CORE_DIST))
    reports = [core]
    owners: dict[str, PluginReport] = {}
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
        owners[module_name] = core
    _load_installed(pm, owners, reports)

    points = extension_points()
    registries = Registries(points)
    for point in points:
        hook = point.hook
        for impl in getattr(pm.hook, hook).get_hookimpls():
            report = owners[impl.plugin_name]
            registrar = Registrar(hook, report, registries.by_hook[hook].register)
            try:
                impl.function(register=registrar)
            except AtomError:
                raise
            except Exception as exc:
                raise PluginConflictError(
                    f"plugin {report.name} failed in {hook}: {type(exc).__name__}: {exc}"
                ) from exc
    return PluginState(pm, registries, reports)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "0+unknown"


_state: PluginState | None = None
_lock = threading.Lock()


def plugin_state() -> PluginState:
    """The process-wide plugin state, built on first use."""
    global _state
    with _lock:
        if _state is None:
            _state = build_plugin_state()
        return _state


def get_registries() -> Registries:
    return plugin_state().registries


def reset_plugins() -> None:
    """Forget the loaded plugins (tests change ATOM_PLUGINS or install a plugin)."""
    global _state
    with _lock:
        _state = None
