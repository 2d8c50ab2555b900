"""Logits of ATOM's Qwen3 against transformers' on a tiny random checkpoint (fp32, CPU)."""

import pytest

from atom_core.testing.model_reference import check_against_transformers


@pytest.mark.parametrize("block_size", [4, 16])
def test_qwen3_matches_transformers(block_size):
    check_against_transformers("qwen3", block_size=block_size, tol=1e-4)
