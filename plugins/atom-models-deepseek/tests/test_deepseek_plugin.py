from atom_core.plugins import build_plugin_state


def test_plugin_is_discovered_and_states_its_status():
    state = build_plugin_state()
    report = next(r for r in state.reports if r.name == "atom-models-deepseek")
    assert report.version == "0.1.0"
    assert "not implemented" in report.declined
    assert "DeepseekV3ForCausalLM" not in state.registries.architectures
