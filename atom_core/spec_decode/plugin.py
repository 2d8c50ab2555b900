"""Registers the core's speculative-decoding proposer: ``ngram`` (prompt lookup, no weights)."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl
from atom_core.spec_decode.ngram import NgramProposer


@hookimpl
def register_spec_decode_proposers(register):
    register("ngram", NgramProposer)
