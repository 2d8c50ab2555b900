"""Logits of ATOM's Llama against transformers' on tiny random checkpoints (fp32, CPU)."""

import pytest

from atom_core.testing.model_reference import check_against_transformers


@pytest.mark.parametrize("kind", ["llama", "llama3", "llama-tied"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_llama_matches_transformers(kind, block_size):
    check_against_transformers(kind, block_size=block_size, tol=1e-4)
