"""Registers LlamaForCausalLM (Llama 2/3, SmolLM2, and other Llama-shaped checkpoints) and
the ``eagle3`` speculative method (EAGLE-3 draft heads, ``--draft-model``)."""

from __future__ import annotations

from typing import Any

from atom_core.hookspecs import hookimpl


@hookimpl
def register_model_architectures(register):
    from atom_models_llama.model import LlamaForCausalLM  # torch imports only when used

    register("LlamaForCausalLM", LlamaForCausalLM)


def eagle3(ctx: Any) -> Any:
    from atom_models_llama.eagle3 import load_eagle3

    return load_eagle3(ctx)


@hookimpl
def register_spec_decode_proposers(register):
    register("eagle3", eagle3)
