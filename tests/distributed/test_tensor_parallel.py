"""Tensor parallelism on CPU (gloo): the tiny random models with their layers split across
two ranks (each holding its slice of the weights) give the logits of one process, on
every rank, through a prefill, a mixed step and a decode step: column/row-parallel linears
with one all-reduce per row-parallel layer, KV heads split, MLA heads split, MoE with the
expert intermediate split, the vocabulary split in the embedding and the LM head."""

from __future__ import annotations

import pytest
import torch

from atom_core.testing.tensor_parallel import model_logits, tensor_parallel_logits
from atom_core.testing.tiny_models import tiny_model_dir

STEPS = [[[5, 9, 3, 7, 1], [11, 2, 8], [4, 4, 6, 10, 12, 14]],
         [[13], [17], [19, 21, 23, 25]],
         [[27], [29], [31]]]
KINDS = ["llama", "qwen3", "qwen3_moe", "deepseek_v2"]


@pytest.mark.slow
def test_two_ranks_give_one_process_logits():
    jobs = [(str(tiny_model_dir(kind)), {}) for kind in KINDS]
    split = tensor_parallel_logits(jobs, STEPS, size=2)
    for kind, (path, config), ranks in zip(KINDS, jobs, split):
        want, whole = model_logits(path, STEPS, **config)
        for rank, (got, held) in enumerate(ranks):
            assert held < 0.75 * whole, (kind, rank, held, whole)  # the layers were split
            for step, (g, w) in enumerate(zip(got, want)):
                assert g.shape == w.shape, (kind, rank, step)
                assert torch.allclose(g, w, rtol=1e-4, atol=1e-4), \
                    (kind, rank, step, (g - w).abs().max().item())


@pytest.mark.slow
def test_four_ranks_replicate_the_kv_heads_they_outnumber():
    """Llama with 4 query heads and 2 KV heads on 4 ranks: each rank one query head and a
    copy of the KV head it reads."""
    path = str(tiny_model_dir("llama"))
    want, whole = model_logits(path, STEPS)
    for got, held in tensor_parallel_logits([(path, {})], STEPS, size=4)[0]:
        assert held < 0.5 * whole
        for g, w in zip(got, want):
            assert torch.allclose(g, w, rtol=1e-4, atol=1e-4), (g - w).abs().max().item()


@pytest.mark.slow
def test_expert_parallel_ranks_give_one_process_logits():
    """Qwen3-MoE (8 routed experts) and DeepSeek-V2 (8 routed, 2 shared) with whole experts
    split across two ranks, attention tensor-parallel."""
    kinds = ["qwen3_moe", "deepseek_v2"]
    jobs = [(str(tiny_model_dir(kind)), {}) for kind in kinds]
    split = tensor_parallel_logits(jobs, STEPS, size=2, expert_parallel=True)
    for kind, (path, _), ranks in zip(kinds, jobs, split):
        want, whole = model_logits(path, STEPS)
        for rank, (got, held) in enumerate(ranks):
            assert held < 0.75 * whole, (kind, rank, held, whole)
            for g, w in zip(got, want):
                assert torch.allclose(g, w, rtol=1e-4, atol=1e-4), \
                    (kind, rank, (g - w).abs().max().item())


@pytest.mark.slow
def test_dp_attention_ranks_give_one_process_logits_of_their_own_tokens():
    """DP attention: each rank its own sequences, attention and dense layers whole, the
    MoE experts split across the ranks, which exchange their tokens in every MoE layer.
    Rank 1 sits a step out (its idle pass still serves rank 0's tokens to its experts)."""
    kinds = ["qwen3_moe", "deepseek_v2"]
    jobs = [(str(tiny_model_dir(kind)), {}) for kind in kinds]
    mine = [[[8, 6, 4, 2], [3, 3]], [], [[10], [12]]]
    split = tensor_parallel_logits(jobs, [STEPS, mine], size=2, dp_attention=True)
    for kind, (path, _), ranks in zip(kinds, jobs, split):
        for rank, steps in enumerate([STEPS, mine]):
            want, whole = model_logits(path, [s for s in steps if s])
            got, held = ranks[rank]
            assert held < whole, (kind, rank)  # the experts were split
            assert [g is None for g in got] == [not s for s in steps]
            for g, w in zip([g for g in got if g is not None], want):
                assert torch.allclose(g, w, rtol=1e-4, atol=1e-4), \
                    (kind, rank, (g - w).abs().max().item())
