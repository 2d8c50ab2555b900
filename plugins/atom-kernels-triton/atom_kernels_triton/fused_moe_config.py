"""Block sizes for the fused-MoE kernels, looked up by (tokens bucket, hidden, inter).

``TUNED`` holds what ``bench/tune_fused_moe.py`` found best on a GPU for a model's
(H, I), per power-of-two token bucket; shapes it lacks fall back to ``default_config``,
picked from the expected rows per expert (T * k / E), which decides how much of each
BLOCK_M tile is real work. A tuned bucket also serves the smaller buckets below it, down
to the next tuned one, while their rows per expert stay in its regime (``regime``): a
prefill bucket's tall tiles never reach a decode batch.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict


class MoeConfig(TypedDict):
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    # > 0: both GEMMs in one persistent launch of at most this many programs an SM
    # (``fused_moe._experts_kernel``); 0 or absent: one launch each.
    PERSISTENT: NotRequired[int]
    # True: the down kernel's programs wait on their own block's gate/up tiles rather than on
    # the whole gate/up launch (``fused_moe._down_kernel``), where the grid allows it.
    OVERLAP: NotRequired[bool]


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
#
# Qwen3-30B-A3B's prefill buckets (2048, 16384): `python bench/tune_fused_moe.py --models
# qwen3-30b-a3b --batch-sizes 2048 16384 --block-m 64 128 --block-n 64 128 256 --block-k 64
# 128 --warps 4 8 --stages 3 4 --no-graph` (eager, as prefill runs; 23 configs each). At
# 16,384 tokens the op took 3,446 us against 4,160 for the heuristic's pick; in
# bench/throughput_offline.py (1024 x 1024 in / 128 out, same device call) the prefill steps
# went 314.7 -> 280.3 ms and the run 33,107 -> 36,857 tok/s. That run also gave the
# 257-512-token bucket (its decode-only steps: 512 sequences, 32 rows an expert) the same
# tiles, and those steps went 65.3 -> 59.8 ms against the heuristic's. The same sweep's pick for
# DeepSeek-V2-Lite (5,498 against 7,017 us alone) made its offline run slower, 38,180 ->
# 37,173 tok/s (prefill steps 306.6 -> 314.6 ms), so its prefill sizes keep the heuristic.
# The table as it stands, against the one before these three buckets (another machine, one
# device call, two interleaved pairs): 30,419 / 30,582 -> 33,542 / 33,378 tok/s.
#
# PERSISTENT (both GEMMs in one launch, as many programs as fit) only in the batch-1 buckets:
# bench/decode_latency.py, one device call, batch 1 Qwen3-30B-A3B 3.266 / 3.265 -> 3.212 /
# 3.220 ms, DeepSeek-V2-Lite 2.562 -> 2.428; at 16 and 32 tokens it was slower (Qwen3-30B-A3B
# batch 32 14.044 -> 14.288 at the table's tiles, 14.43-14.70 at tiles that fit more programs;
# DeepSeek-V2-Lite 8.802 -> 8.912): there the weight reads dominate and a program's items
# run one after another, where separate launches overlap them.
#
# OVERLAP (down tiles wait on their own block's gate/up tiles, not the whole launch) in the
# decode buckets past batch 1: bench/decode_latency.py, plain wait -> overlap in one device
# call, batch 32 Qwen3-30B-A3B 14.109 / 14.109 -> 13.803 / 13.805 ms, DeepSeek-V2-Lite 9.001 /
# 8.991 -> 8.676 / 8.673; batches 8 and 16 0.12-0.25 ms faster (bench/RESULTS.md, twenty-fifth
# session). Other tiles with it were slower. Where the grid fits the GPU (Qwen3-30B-A3B at 2-4
# tokens) the launcher keeps the plain wait.
TUNED: dict[tuple[int, int], dict[int, MoeConfig]] = {
    (2048, 768): {
        1: MoeConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, PERSISTENT=64),
        32: MoeConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=2, num_stages=3, OVERLAP=True),
        512: MoeConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
        2048: MoeConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
        16384: MoeConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    },
    (2048, 1408): {
        1: MoeConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3, PERSISTENT=64),
        32: MoeConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, OVERLAP=True),
    },
}


def token_bucket(num_tokens: int) -> int:
    """The power of two at or above num_tokens (1, 2, 4, ...)."""
    return 1 << max(0, num_tokens - 1).bit_length()


def regime(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Which of ``default_config``'s three cases T tokens fall in (0 decode, 1 between, 2
    prefill), from the rows each expert expects."""
    rows_per_expert = num_tokens * top_k / num_experts
    return 0 if rows_per_expert <= 16 else 1 if rows_per_expert <= 64 else 2


def default_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    case = regime(num_tokens, top_k, num_experts)
    if case == 0:  # decode: mostly padding, keep M small and stream weights
        return MoeConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if case == 1:
        return MoeConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return MoeConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def get_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> MoeConfig:
    table = TUNED.get((hidden, inter))
    if table:
        bucket = token_bucket(num_tokens)
        # The nearest tuned bucket at or above this one, if it was tuned for the same kind of
        # batch; past the largest tuned, or across a regime, the shape heuristic knows better.
        above = [b for b in table if b >= bucket]
        if above:
            nearest = min(above)
            if regime(nearest, top_k, num_experts) == regime(num_tokens, top_k, num_experts):
                return table[nearest]
    return default_config(num_tokens, top_k, num_experts)
