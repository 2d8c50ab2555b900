"""Registers Qwen3ForCausalLM (the dense Qwen3 models)."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl


@hookimpl
def register_model_architectures(register):
    from atom_models_qwen.model import Qwen3ForCausalLM  # torch imports only when used

    register("Qwen3ForCausalLM", Qwen3ForCausalLM)
