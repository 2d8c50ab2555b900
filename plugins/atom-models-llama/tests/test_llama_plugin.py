from atom_core.plugins import build_plugin_state


def test_plugin_registers_llama():
    state = build_plugin_state()
    report = next(r for r in state.reports if r.name == "atom-models-llama")
    assert report.declined is None
    assert report.registered["register_model_architectures"] == ["LlamaForCausalLM"]
    from atom_models_llama.model import LlamaForCausalLM

    assert state.registries.architectures.get("LlamaForCausalLM") is LlamaForCausalLM
