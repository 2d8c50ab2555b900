from atom_core.plugins import build_plugin_state


def test_plugin_registers_glm4_moe():
    state = build_plugin_state()
    report = next(r for r in state.reports if r.name == "atom-models-glm")
    assert report.declined is None
    assert report.registered["register_model_architectures"] == ["Glm4MoeForCausalLM"]
    from atom_models_glm.model import Glm4MoeForCausalLM

    assert state.registries.architectures.get("Glm4MoeForCausalLM") is Glm4MoeForCausalLM
