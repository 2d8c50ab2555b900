"""Block sizes for the fused-MoE kernels, looked up by (tokens bucket, hidden, inter).

``TUNED`` holds what ``bench/tune_fused_moe.py`` found best on a GPU for a model's
(H, I), per power-of-two token bucket; shapes it lacks fall back to ``default_config``,
picked from the expected rows per expert (T * k / E), which decides how much of each
BLOCK_M tile is real work.
"""

from __future__ import annotations

from typing import TypedDict


class MoeConfig(TypedDict):
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


# (hidden, inter) -> {token bucket: config}, from `python bench/tune_fused_moe.py
# --batch-sizes 1 32` on one NVIDIA H200, bf16, graph replay (bench/results/fused_moe_tuning.json):
# Qwen3-30B-A3B (E 128, k 8) and DeepSeek-V2-Lite (E 64, k 6) decode batches. Except
# Qwen3-30B-A3B's 32 bucket (2-32 tokens), chosen in the model: each kernel alone at 32
# tokens (112 experts touched) had the gate_up kernel at 161.7 us against the sweep's pick's
# 164.6 and the down kernel level (85.7 / 85.6); in bench/decode_latency.py (two interleaved
# pairs per batch size, one device call each) a batch-32 step went 14.665 / 14.667 ->
# 14.512 / 14.515 ms and a batch-16 step 11.280 / 11.283 -> 11.170 / 11.170. The same change
# for DeepSeek-V2-Lite (32 x 128 in 4 stages) slowed its batch-32 step, 9.183 / 9.188 ->
# 9.229 / 9.230.
TUNED: dict[tuple[int, int], dict[int, MoeConfig]] = {
    (2048, 768): {
        1: MoeConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
        32: MoeConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=2, num_stages=3),
    },
    (2048, 1408): {
        1: MoeConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3),
        32: MoeConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    },
}


def token_bucket(num_tokens: int) -> int:
    """The power of two at or above num_tokens (1, 2, 4, ...)."""
    return 1 << max(0, num_tokens - 1).bit_length()


def default_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:  # decode: mostly padding, keep M small and stream weights
        return MoeConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if rows_per_expert <= 64:
        return MoeConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return MoeConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def get_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> MoeConfig:
    table = TUNED.get((hidden, inter))
    if table:
        bucket = token_bucket(num_tokens)
        # The nearest tuned bucket at or above this one; past the largest tuned (prefill
        # sizes when only decode was tuned) the shape heuristic knows better.
        above = [b for b in table if b >= bucket]
        if above:
            return table[min(above)]
    return default_config(num_tokens, top_k, num_experts)
