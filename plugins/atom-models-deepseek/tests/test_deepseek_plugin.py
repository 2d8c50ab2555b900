from atom_core.plugins import build_plugin_state


def test_plugin_registers_deepseek_v2_and_v3():
    state = build_plugin_state()
    report = next(r for r in state.reports if r.name == "atom-models-deepseek")
    assert report.version == "0.1.0"
    assert report.declined is None
    assert report.registered["register_model_architectures"] == [
        "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    ]
    from atom_models_deepseek.model import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    archs = state.registries.architectures
    assert archs.get("DeepseekV2ForCausalLM") is DeepseekV2ForCausalLM
    assert archs.get("DeepseekV3ForCausalLM") is DeepseekV3ForCausalLM
