"""Registers MiniMaxM2ForCausalLM (MiniMax-M2)."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl


@hookimpl
def register_model_architectures(register):
    from atom_models_minimax.model import MiniMaxM2ForCausalLM  # torch imports only when used

    register("MiniMaxM2ForCausalLM", MiniMaxM2ForCausalLM)
