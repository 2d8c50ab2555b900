"""Specs compiled against one model's tokenizer, each once: ``GrammarCompiler``.

llguidance has no separate compiled form: a matcher built from a grammar is the compiled
grammar (its lexer and parser tables, built at construction, about 1-2 ms for a realistic
schema on a 2-core VM), and ``deep_copy`` of it costs a fraction of that. So the cache
holds one pristine matcher per spec, keyed by the spec's xxhash, and every request with
that spec starts from a copy. The tokenizer's view (the token trie, 0.3-0.7 s for a 49k
vocabulary) is built at the first constrained request, not at start-up, so a server that
never sees one never pays it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from atom_core.errors import InvalidRequestError
from atom_core.structured.matcher import GrammarMatcher
from atom_core.structured.spec import StructuredSpec


class GrammarCompiler:
    """``matcher(spec)`` for the model whose ``tokenizer`` (a transformers fast tokenizer,
    or None) and logits width ``vocab_size`` it is built with; ``eos_token_ids`` are the
    tokens that end a sequence (allowed once the grammar is complete)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 capacity: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.capacity = capacity
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[int, tuple[StructuredSpec, Any]] = OrderedDict()

    def ll_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured outputs need the model's tokenizer, "
                                          "and this model has none")
            import llguidance.hf

            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None)
            except Exception as exc:  # a slow tokenizer, a vocabulary llguidance cannot read
                # The request's refusal, not the engine's death: the engine process runs this.
                raise InvalidRequestError(
                    f"structured outputs are not available for this model's tokenizer: {exc}"
                ) from None
        return self._ll_tokenizer

    def matcher(self, spec: StructuredSpec) -> GrammarMatcher:
        """A fresh matcher for ``spec``; InvalidRequestError naming ``spec.param`` when it
        does not compile."""
        hit = self._cache.get(spec.key)
        if hit is not None and hit[0] == spec:
            self._cache.move_to_end(spec.key)
            return GrammarMatcher(hit[1].deep_copy())
        import llguidance

        try:
            grammar = spec.grammar()
        except ValueError as exc:
            raise InvalidRequestError(f"{spec.param}: {exc}", param=spec.param) from None
        template = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if template.is_error():
            raise InvalidRequestError(f"{spec.param}: {template.get_error()}", param=spec.param)
        self._cache[spec.key] = (spec, template)
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return GrammarMatcher(template.deep_copy())
