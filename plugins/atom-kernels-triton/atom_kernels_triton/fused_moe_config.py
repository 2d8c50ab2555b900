"""Block sizes for the fused-MoE kernels, looked up by (tokens bucket, hidden, inter).

The device's table (``configs/fused_moe/<device>.json``, see tuning.py) holds what
``bench/tune_fused_moe.py`` found best for a model's (H, I), per power-of-two token bucket,
and the launch forms (``PERSISTENT``, ``OVERLAP``) chosen by timing the model (the file's
``in_model``). Shapes it lacks fall back to ``default_config``, picked from the expected
rows per expert (T * k / E), which decides how much of each BLOCK_M tile is real work. A
tuned bucket also serves the smaller buckets below it, down to the next tuned one, while
their rows per expert stay in its regime (``regime``): a prefill bucket's tall tiles never
reach a decode batch.

FP8 stacks have keys of their own, (H, I, format) with the format ``WEIGHT_ONLY`` or
``W8A8`` (``tune_fused_moe.py --fp8``): an e4m3 tile of the same shape moves half the bytes
of a bf16 one, so the best shapes may differ. Where the table has no such key, an fp8 launch
takes the model-dtype entry adapted to its format (``for_fp8_weights``, ``for_w8a8``).
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

from atom_kernels_triton import tuning

OP = "fused_moe"


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


# (H, I) for model-dtype stacks, (H, I, format) for fp8 ones -> token bucket -> tiles.
MoeTable = dict[tuple[int, ...], dict[int, MoeConfig]]

# An fp8 stack's GEMM format, as in fused_moe_fp8 (which picks it by the step's size) and
# the third number of an fp8 table key.
WEIGHT_ONLY, W8A8 = 1, 2

# The tensor cores' e4m3 products take K in steps of 32: a W8A8 dot's K tile is no smaller.
FP8_MIN_BLOCK_K = 32


def tuned(device: str | None) -> MoeTable:
    """The table of the device named ``device`` (``tuning.device_name``), empty where none was
    measured. One object per device: overriding an entry reaches every later launch."""
    return tuning.load(OP, device).configs  # type: ignore[return-value]


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


def get_config(
    num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
    table: MoeTable | None = None, fp8_format: int = 0,
) -> MoeConfig:
    """``table``: the weights' device's (default: the current device's). ``fp8_format``
    (``WEIGHT_ONLY`` or ``W8A8``, 0 for model-dtype stacks): the tiles swept for that format
    where the table has them, else the model dtype's adapted to it."""
    if table is None:
        table = tuned(tuning.device_name())
    if fp8_format:
        swept = _tuned(table.get((hidden, inter, fp8_format)), num_tokens, top_k, num_experts)
        if swept is not None:
            return for_w8a8(swept) if fp8_format == W8A8 else swept
    config = _tuned(table.get((hidden, inter)), num_tokens, top_k, num_experts)
    if config is None:
        config = default_config(num_tokens, top_k, num_experts)
    if fp8_format == WEIGHT_ONLY:
        return for_fp8_weights(config)
    return for_w8a8(config) if fp8_format == W8A8 else config


def _tuned(per_bucket: dict[int, MoeConfig] | None, num_tokens: int, top_k: int,
           num_experts: int) -> MoeConfig | None:
    """The nearest tuned bucket at or above ``num_tokens``'s if it was tuned for the same
    kind of batch; past the largest tuned, or across a regime, None: the shape heuristic
    knows better."""
    if not per_bucket:
        return None
    bucket = token_bucket(num_tokens)
    above = [b for b in per_bucket if b >= bucket]
    if not above:
        return None
    nearest = min(above)
    if regime(nearest, top_k, num_experts) != regime(num_tokens, top_k, num_experts):
        return None
    return per_bucket[nearest]


def for_fp8_weights(config: MoeConfig) -> MoeConfig:
    """The table's ``config`` for e4m3 weights multiplied in the model dtype (weight-only).
    The model-dtype tiles serve as they are, but for the persistent (one-token) launch's,
    whose K tile doubles to the bytes of the tile it was tuned as: a program's K steps are
    then as few as the model dtype's, each loading as much (H200, Qwen3-30B-A3B at one
    token: 57 us with the table's tile, 43 us doubled, 42 us for bf16; at 8-32 tokens the
    table's tile is the faster)."""
    if not config.get("PERSISTENT", 0):
        return config
    return MoeConfig({**config, "BLOCK_K": 2 * config["BLOCK_K"]})


def for_w8a8(config: MoeConfig) -> MoeConfig:
    """``config`` for e4m3 x e4m3 tiles: the same, its BLOCK_K raised to FP8_MIN_BLOCK_K.
    The table's tiles, tuned for model-dtype stacks, serve fp8 stacks as they are."""
    if config["BLOCK_K"] >= FP8_MIN_BLOCK_K:
        return config
    return MoeConfig({**config, "BLOCK_K": FP8_MIN_BLOCK_K})
