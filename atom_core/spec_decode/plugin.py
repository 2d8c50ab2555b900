"""Registers the core's speculative-decoding methods: ``ngram`` (prompt lookup, no weights)
and ``draft_model`` (any causal LM sharing the target's vocabulary, ``--draft-model``).
Their modules are imported when a method is used (the server's frontend loads the
registries too, and needs no torch)."""

from __future__ import annotations

from typing import Any

from atom_core.hookspecs import hookimpl


def ngram(ctx: Any) -> Any:
    from atom_core.spec_decode.ngram import NgramProposer

    return NgramProposer()


def draft_model(ctx: Any) -> Any:
    from atom_core.spec_decode.draft_model import load_draft_model

    return load_draft_model(ctx)


@hookimpl
def register_spec_decode_proposers(register):
    register("ngram", ngram)
    register("draft_model", draft_model)
