from atom_core.plugins import build_plugin_state


def test_plugin_registers_qwen3_and_qwen3_moe():
    state = build_plugin_state()
    report = next(r for r in state.reports if r.name == "atom-models-qwen")
    assert report.declined is None
    assert report.registered["register_model_architectures"] == [
        "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    ]
    from atom_models_qwen.model import Qwen3ForCausalLM
    from atom_models_qwen.qwen3_moe import Qwen3MoeForCausalLM

    assert state.registries.architectures.get("Qwen3ForCausalLM") is Qwen3ForCausalLM
    assert state.registries.architectures.get("Qwen3MoeForCausalLM") is Qwen3MoeForCausalLM
