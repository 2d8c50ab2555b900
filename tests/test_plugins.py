"""The plugin system: discovery through entry points, conflicts, ATOM_PLUGINS, declining."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pluggy
import pytest

from atom_core import hookspecs, plugins
from atom_core.errors import PluginConflictError, UnsupportedError
from atom_core.hookspecs import extension_point, hookimpl, hookspec
from atom_core.plugins import (
    PluginReport,
    Registrar,
    allowed_distributions,
    build_plugin_state,
    extension_points,
)
from atom_core.registries import NamedRegistry, OpImpl, OpRegistry, Registries
from tests.plugin_dists import pip_install, plugins_json, run_atom, write_dist

PLUGIN_DISTS = {
    "atom-models-llama",
    "atom-models-qwen",
    "atom-models-deepseek",
    "atom-models-gptoss",
    "atom-models-glm",
    "atom-models-minimax",
    "atom-toolformats",
    "atom-kernels-aiter",
}

FORMAT_PLUGIN = """
from atom_core.parsing import ToolFormat
from atom_core.hookspecs import hookimpl

class Fmt(ToolFormat):
    START_MARKERS = ("<call>",)

@hookimpl
def register_tool_formats(register):
    register("{name}", Fmt)
"""


def test_lists_every_plugin_distribution_with_versions():
    reports = {r["name"]: r for r in plugins_json()}
    assert PLUGIN_DISTS <= set(reports)
    for name in PLUGIN_DISTS | {"atom-core"}:
        assert reports[name]["version"] == "0.1.0"
        assert set(reports[name]) == {"name", "version", "registered", "declined"}
    core = reports["atom-core"]
    assert "rms_norm[native]" in core["registered"]["register_ops"]
    assert core["declined"] is None


def test_table_output_names_each_plugin():
    proc = run_atom(["plugins"])
    assert proc.returncode == 0, proc.stderr
    for name in PLUGIN_DISTS:
        assert name in proc.stdout


def test_version_flag():
    proc = run_atom(["--version"])
    assert proc.returncode == 0
    assert proc.stdout.strip() == "atom 0.1.0"


@pytest.mark.slow
def test_installed_third_party_plugin_is_discovered_and_called(tmp_path: Path):
    body = FORMAT_PLUGIN.format(name="throwaway")
    src = write_dist(tmp_path / "src", "atom-throwaway", "atom_throwaway", body)
    site = tmp_path / "site"
    pip_install(src, site)
    reports = {r["name"]: r for r in plugins_json(site)}
    assert reports["atom-throwaway"] == {
        "name": "atom-throwaway",
        "version": "1.2.3",
        "registered": {"register_tool_formats": ["throwaway"]},
        "declined": None,
    }


@pytest.mark.slow
def test_duplicate_name_fails_naming_both_distributions(tmp_path: Path):
    site = tmp_path / "site"
    for dist in ("atom-dup-one", "atom-dup-two"):
        module = dist.replace("-", "_")
        body = FORMAT_PLUGIN.format(name="clash")
        pip_install(write_dist(tmp_path / "src", dist, module, body), site)
    proc = run_atom(["plugins", "--json"], site)
    assert proc.returncode == 1
    assert "'clash' is registered twice" in proc.stderr
    assert "atom-dup-one" in proc.stderr and "atom-dup-two" in proc.stderr


def test_atom_plugins_limits_what_loads():
    only_core = plugins_json(ATOM_PLUGINS="")
    assert [r["name"] for r in only_core] == ["atom-core"]
    some = plugins_json(ATOM_PLUGINS="atom_models_llama, atom-toolformats")
    assert {r["name"] for r in some} == {"atom-core", "atom-models-llama", "atom-toolformats"}


def test_allowed_distributions_parsing(monkeypatch):
    monkeypatch.delenv("ATOM_PLUGINS", raising=False)
    assert allowed_distributions() is None
    monkeypatch.setenv("ATOM_PLUGINS", "")
    assert allowed_distributions() == set()
    monkeypatch.setenv("ATOM_PLUGINS", "Atom.Models_Qwen,")
    assert allowed_distributions() == {"atom-models-qwen"}


def test_decline_records_first_reason_and_never_raises():
    report = PluginReport("atom-x", "1")
    reg = Registrar("register_ops", report, lambda *a, **k: "unused")
    reg.decline("no ROCm:\n torch has no HIP")
    reg.decline("second reason")
    assert report.declined == "no ROCm: torch has no HIP"
    assert report.registered == {}


def _impl(provider, priority, kinds=("cpu", "cuda")):
    return OpImpl("rms_norm", lambda: provider, provider, kinds, priority, f"dist-{provider}")


def test_op_resolution_by_priority_device_and_forced_provider(monkeypatch):
    monkeypatch.delenv("ATOM_OPS_PROVIDER", raising=False)
    ops = OpRegistry()
    ops.add(_impl("native", 0))
    ops.add(_impl("triton", 10, ("cuda",)))
    assert ops.resolve("rms_norm", "cpu").provider == "native"
    assert ops.resolve("rms_norm", "cuda").provider == "triton"
    monkeypatch.setenv("ATOM_OPS_PROVIDER", "native")
    assert ops.resolve("rms_norm", "cuda").provider == "native"
    monkeypatch.setenv("ATOM_OPS_PROVIDER", "triton")
    with pytest.raises(UnsupportedError, match="ATOM_OPS_PROVIDER=triton"):
        ops.resolve("rms_norm", "cpu")
    with pytest.raises(UnsupportedError, match="no implementation of op 'nope'"):
        ops.resolve("nope", "cuda")


def test_same_op_and_provider_twice_is_a_conflict():
    ops = OpRegistry()
    ops.add(_impl("native", 0))
    with pytest.raises(PluginConflictError, match="dist-native"):
        ops.add(_impl("native", 5))


def test_builtin_defaults_register_through_hooks(monkeypatch):
    monkeypatch.setenv("ATOM_PLUGINS", "")
    state = build_plugin_state()
    assert [r.name for r in state.reports] == ["atom-core"]
    assert state.registries.ops.resolve("silu_and_mul", "cpu").dist == "atom-core"


def test_the_hooks_are_the_hookspecs_functions():
    pm = pluggy.PluginManager("atom")
    pm.add_hookspecs(hookspecs)
    hooks = [p.hook for p in extension_points()]
    assert hooks[0] == "register_model_architectures" and len(hooks) == len(set(hooks))
    assert set(hooks) == {h for h in vars(pm.hook) if not h.startswith("_")}


def test_registries_declared_for_type_checkers_are_the_hookspecs_ones():
    registries = Registries(extension_points())
    for attribute, type_name in Registries.__annotations__.items():
        assert type(getattr(registries, attribute)).__name__ == type_name


def test_a_new_hook_is_its_hookspec_alone(monkeypatch):
    """A hook spec added to hookspecs.py is called on plugins and fills its registry, with no
    edit anywhere else."""

    @extension_point("widgets", lambda: NamedRegistry("widget"))
    def register_widgets(register):
        """Provide widgets."""

    class Gear:
        pass

    def provide(register):
        register("gear", Gear)

    plugin = types.ModuleType("atom_widget_plugin")
    plugin.register_widgets = hookimpl(provide)  # pluggy names a hook by the attribute
    monkeypatch.setattr(hookspecs, "register_widgets", register_widgets, raising=False)
    monkeypatch.setitem(sys.modules, plugin.__name__, plugin)
    monkeypatch.setattr(plugins, "DEFAULT_PLUGINS", (*plugins.DEFAULT_PLUGINS, plugin.__name__))
    monkeypatch.setenv("ATOM_PLUGINS", "")
    state = build_plugin_state()
    assert state.registries.widgets.get("gear") is Gear
    assert state.reports[0].registered["register_widgets"] == ["gear"]
    with pytest.raises(UnsupportedError, match="unknown widget 'bolt'; known: gear"):
        state.registries.widgets.get("bolt")


def test_a_hookspec_without_a_registry_is_refused(monkeypatch):
    @hookspec
    def register_things(register):
        """Provide things."""

    monkeypatch.setattr(hookspecs, "register_things", register_things, raising=False)
    with pytest.raises(TypeError, match="register_things has no registry"):
        extension_points()


def test_a_registration_needs_a_string_name():
    report = PluginReport("atom-x", "1")
    reg = Registrar("register_ops", report, lambda *a, **k: "unused")
    with pytest.raises(PluginConflictError, match="atom-x: register_ops needs a non-empty string"):
        reg("", object)
    assert report.registered == {}
