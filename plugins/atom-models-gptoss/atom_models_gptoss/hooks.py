"""Registers GptOssForCausalLM (gpt-oss-20b, gpt-oss-120b)."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl


@hookimpl
def register_model_architectures(register):
    from atom_models_gptoss.model import GptOssForCausalLM  # torch imports only when used

    register("GptOssForCausalLM", GptOssForCausalLM)
