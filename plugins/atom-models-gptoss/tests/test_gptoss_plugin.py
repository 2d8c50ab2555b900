from atom_core.plugins import build_plugin_state


def test_plugin_registers_gpt_oss():
    state = build_plugin_state()
    report = next(r for r in state.reports if r.name == "atom-models-gptoss")
    assert report.declined is None
    assert report.registered["register_model_architectures"] == ["GptOssForCausalLM"]
    from atom_models_gptoss.model import GptOssForCausalLM

    assert state.registries.architectures.get("GptOssForCausalLM") is GptOssForCausalLM
