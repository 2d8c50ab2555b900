"""The plugin system: discovery through entry points, conflicts, ATOM_PLUGINS, declining."""

from __future__ import annotations

from pathlib import Path

import pytest

from atom_core.errors import PluginConflictError, UnsupportedError
from atom_core.plugins import PluginReport, Registrar, allowed_distributions, build_plugin_state
from atom_core.registries import OpImpl, OpRegistry
from tests.plugin_dists import pip_install, plugins_json, run_atom, write_dist

PLUGIN_DISTS = {
    "atom-models-llama",
    "atom-models-qwen",
    "atom-models-deepseek",
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
    src = write_dist(tmp_path / "src", "atom-throwaway", "atom_throwaway", FORMAT_PLUGIN.format(name="throwaway"))
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
        pip_install(write_dist(tmp_path / "src", dist, module, FORMAT_PLUGIN.format(name="clash")), site)
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
