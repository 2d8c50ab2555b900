"""Registers LlamaForCausalLM (Llama 2/3, SmolLM2, and other Llama-shaped checkpoints)."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl


@hookimpl
def register_model_architectures(register):
    from atom_models_llama.model import LlamaForCausalLM  # torch imports only when used

    register("LlamaForCausalLM", LlamaForCausalLM)
