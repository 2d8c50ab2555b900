"""Registers DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (MLA + mixture of experts),
and the ``mtp`` speculative-decoding method (DeepSeek-V3's multi-token prediction)."""

from __future__ import annotations

from typing import Any

from atom_core.hookspecs import hookimpl


@hookimpl
def register_model_architectures(register):
    from atom_models_deepseek.model import (  # torch imports only when used
        DeepseekV2ForCausalLM,
        DeepseekV3ForCausalLM,
    )

    register("DeepseekV2ForCausalLM", DeepseekV2ForCausalLM)
    register("DeepseekV3ForCausalLM", DeepseekV3ForCausalLM)


def mtp(ctx: Any) -> Any:
    from atom_models_deepseek.mtp import load_mtp  # the server's frontend needs no torch

    return load_mtp(ctx)


@hookimpl
def register_spec_decode_proposers(register):
    register("mtp", mtp)
