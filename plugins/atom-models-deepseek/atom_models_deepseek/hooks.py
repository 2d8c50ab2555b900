"""Registers DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (MLA + mixture of experts)."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl


@hookimpl
def register_model_architectures(register):
    from atom_models_deepseek.model import (  # torch imports only when used
        DeepseekV2ForCausalLM,
        DeepseekV3ForCausalLM,
    )

    register("DeepseekV2ForCausalLM", DeepseekV2ForCausalLM)
    register("DeepseekV3ForCausalLM", DeepseekV3ForCausalLM)
