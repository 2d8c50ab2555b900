"""GLM-4.5 through the real LLMEngine against transformers: 32 greedy tokens for 4
prompts of different lengths, batched, identical token for token -- with prefix caching
and chunked prefill -- and prompt logprobs within 1e-4."""

from __future__ import annotations

import pytest

from atom_core.testing.engine_reference import check_engine_against_transformers
from atom_core.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow


def test_engine_matches_transformers():
    check_engine_against_transformers(tiny_model_dir("glm4_moe"))
