from atom_core.plugins import build_plugin_state


def test_plugin_registers_minimax_m2():
    state = build_plugin_state()
    report = next(r for r in state.reports if r.name == "atom-models-minimax")
    assert report.declined is None
    assert report.registered["register_model_architectures"] == ["MiniMaxM2ForCausalLM"]
    from atom_models_minimax.model import MiniMaxM2ForCausalLM

    assert state.registries.architectures.get("MiniMaxM2ForCausalLM") is MiniMaxM2ForCausalLM
