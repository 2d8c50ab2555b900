"""Registers Qwen3ForCausalLM (the dense Qwen3 models) and Qwen3MoeForCausalLM (Qwen3-MoE)."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl


@hookimpl
def register_model_architectures(register):
    from atom_models_qwen.model import Qwen3ForCausalLM  # torch imports only when used
    from atom_models_qwen.qwen3_moe import Qwen3MoeForCausalLM

    register("Qwen3ForCausalLM", Qwen3ForCausalLM)
    register("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM)
