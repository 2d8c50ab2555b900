"""Registers ReplayForCausalLM."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl


@hookimpl
def register_model_architectures(register):
    from atom_replay_model.model import ReplayForCausalLM  # torch imports only when used

    register("ReplayForCausalLM", ReplayForCausalLM)
