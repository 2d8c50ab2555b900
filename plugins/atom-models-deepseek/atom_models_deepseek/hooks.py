"""Registers the DeepSeek architectures once they exist; until then says so in `atom plugins`."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl

NOT_YET = (
    "DeepseekV2ForCausalLM/DeepseekV3ForCausalLM are not implemented in this version "
    "(MLA + MoE land with the mixture-of-experts work)"
)


@hookimpl
def register_model_architectures(register):
    register.decline(NOT_YET)
