"""Registers Glm4MoeForCausalLM (GLM-4.5, GLM-4.5-Air, GLM-4.6)."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl


@hookimpl
def register_model_architectures(register):
    from atom_models_glm.model import Glm4MoeForCausalLM  # torch imports only when used

    register("Glm4MoeForCausalLM", Glm4MoeForCausalLM)
