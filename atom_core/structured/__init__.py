"""Structured outputs: a request's constraint (``StructuredSpec``, in SamplingParams), its
compiled grammar (``GrammarCompiler``, in the engine) and each sequence's matcher, which
masks the sampler's logits every step (docs/structured_outputs.md)."""

from atom_core.structured.compiler import GrammarCompiler
from atom_core.structured.matcher import GrammarMatcher, bitmask_width, fill_bitmask
from atom_core.structured.spec import StructuredSpec

__all__ = ["GrammarCompiler", "GrammarMatcher", "StructuredSpec", "bitmask_width",
           "fill_bitmask"]
