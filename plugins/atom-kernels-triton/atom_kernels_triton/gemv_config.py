"""Block sizes for the ``linear`` op (gemv.py): the device's measured table, and a heuristic
for shapes it lacks. e4m3 weights (``Fp8Weight``) derive theirs from the 16-bit ones
(``fp8_config``).

The table (``configs/gemv/<device>.json``, see tuning.py) maps (N, K) and a row bucket (1,
2, 4, ..., 16, and WIDE_ROWS) to the fastest config ``bench/gemv.py`` swept where it beat
cuBLAS by a margin, else null, which makes the op call cuBLAS (``F.linear``): the Triton
kernel wins on the small projections, where cuBLAS's fixed costs and too few tiles dominate;
the large ones cuBLAS already streams near the copy bandwidth. The entries listed in the
file's ``in_model`` were chosen by timing the whole model (``bench/decode_latency.py
--gemv-config``), and ``bench/gemv.py`` keeps them when it rewrites the table. On a device
without a table the heuristic serves every shape.
"""

from __future__ import annotations

from typing import TypedDict

from atom_kernels_triton import tuning

OP = "gemv"
MAX_ROWS = 16
# Past MAX_ROWS the kernel takes rows in blocks of MAX_ROWS, each block reading W again: that
# pays only for a W small enough to stay in L2 (the MoE routers' fp32 gates), up to
# ROW_BLOCKS_MAX_ROWS rows; larger weights and prefills go to cuBLAS.
ROW_BLOCKS_MAX_WEIGHT_BYTES = 2 << 20
ROW_BLOCKS_MAX_ROWS = 128
# 17..WIDE_ROWS rows run as one 32-row tile (W x^T: gemv.py) where the table has a WIDE_ROWS
# entry for the shape (a 16-bit W), else cuBLAS.
WIDE_ROWS = 32
H200_SMS = 132  # what the interpreter (CPU tensors) sizes grids for


class GemvConfig(TypedDict):
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int
    num_warps: int
    num_stages: int


GemvTable = dict[tuple[int, int], dict[int, GemvConfig | None]]


def tuned(device: str | None) -> GemvTable:
    """The table of the device named ``device`` (``tuning.device_name``), empty where none was
    measured. One object per device: overriding an entry reaches every later launch."""
    return tuning.load(OP, device).configs  # type: ignore[return-value]


def _current() -> GemvTable:
    return tuned(tuning.device_name())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def m_bucket(m: int) -> int:
    """The power of two at or above m (1, 2, 4, 8, 16, 32)."""
    return 1 << max(0, m - 1).bit_length()


def wide_config(
    m: int, n: int, k: int, elem_size: int, table: GemvTable | None = None
) -> GemvConfig | None:
    """The table's 32-row tile for MAX_ROWS < m <= WIDE_ROWS rows of a 16-bit W, or None.
    ``table``: the weight's device's (default: the current device's)."""
    if not MAX_ROWS < m <= WIDE_ROWS or elem_size != 2:
        return None
    return (_current() if table is None else table).get((n, k), {}).get(WIDE_ROWS)


def default_config(m: int, n: int, k: int, elem_size: int, num_sms: int = H200_SMS) -> GemvConfig:
    """Block sizes from the shape alone.

    Bandwidth needs bytes in flight on every SM, so the grid aims at >= 2 programs per SM:
    the widest BLOCK_N that reaches it (wider tiles issue more loads per iteration), else
    the narrowest plus SPLIT_K (a power of two, <= 8, each split >= 2 BLOCK_K chunks so
    the second kernel stays worth it). BLOCK_K is 64 16-byte vectors along K for the
    1-row path (one per thread of 2 warps per W row), half that for the ``tl.dot`` path,
    whose pipeline stages hold (BLOCK_N + 16) x BLOCK_K tiles in shared memory. fp32
    weights on several rows take gemv.py's FMA path: ``_fma_config``.
    """
    vec = 16 // elem_size
    target = 2 * num_sms
    if m > 1 and elem_size == 4:
        return _fma_config(m, n, k, vec, target)
    widths = (16, 8, 4) if m == 1 else (64, 32, 16)
    block_k = min(_next_power_of_2(k), (64 if m == 1 else 32) * vec)
    block_n = next((w for w in widths if _cdiv(n, w) >= target), widths[-1])
    programs = _cdiv(n, block_n)
    split_k = 1
    while programs * split_k < target and split_k < 8 and _cdiv(k, block_k) >= 4 * split_k:
        split_k *= 2
    return GemvConfig(
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4,
        num_stages=2 if m == 1 else 3
    )


def _fma_config(m: int, n: int, k: int, vec: int, target: int) -> GemvConfig:
    """gemv.py's FMA path (an fp32 weight on several rows: the MoE routers). BLOCK_K as the
    1-row path's; BLOCK_N as wide as its [rows, BLOCK_N, BLOCK_K] fp32 tile allows (128
    values a thread at 4 warps); SPLIT_K while the grid, row blocks included, stays within
    ``target``. The rule picks what bench/router_gemv.py's sweep found fastest for
    Qwen3-30B-A3B's 128 x 2048 router on an H200 at 8, 32 and 128 rows.
    """
    rows = min(MAX_ROWS, _next_power_of_2(m))
    row_blocks = _cdiv(m, rows)
    block_k = min(_next_power_of_2(k), 64 * vec)
    widest = max(4, 128 * 128 // (rows * block_k))
    block_n = next((w for w in (16, 8, 4) if w <= widest and _cdiv(n, w) * row_blocks >= target), 4)
    programs = _cdiv(n, block_n) * row_blocks
    split_k = 1
    while 2 * programs * split_k <= target and split_k < 8 and _cdiv(k, block_k) >= 4 * split_k:
        split_k *= 2
    return GemvConfig(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4, num_stages=2)


def _tuned(m: int, per_m: dict[int, GemvConfig | None]) -> GemvConfig | None:
    buckets = [b for b in per_m if b <= MAX_ROWS]  # 16-row tiles (past MAX_ROWS: row blocks)
    # The nearest tuned bucket at or above this one, else the largest tuned.
    above = [b for b in buckets if b >= m_bucket(m)]
    return per_m[min(above) if above else max(buckets)]


def get_config(
    m: int, n: int, k: int, elem_size: int, num_sms: int = H200_SMS,
    table: GemvTable | None = None,
) -> GemvConfig | None:
    """The config for an [m, k] x [n, k]^T product, or None where cuBLAS is faster (never
    for e4m3 weights: ``fp8_config``). ``table``: the weight's device's (default: the
    current device's)."""
    table = _current() if table is None else table
    if elem_size == 1:
        return fp8_config(m, n, k, num_sms, table)
    wide = wide_config(m, n, k, elem_size, table)
    if wide is not None:
        return wide
    # The table was measured on 2-byte weights; fp32 tiles that size overflow shared memory.
    per_m = table.get((n, k)) if elem_size == 2 else None
    if per_m:
        return _tuned(m, per_m)
    return default_config(m, n, k, elem_size, num_sms)


def fp8_config(
    m: int, n: int, k: int, num_sms: int = H200_SMS, table: GemvTable | None = None
) -> GemvConfig:
    """The config for an e4m3 W (an ``Fp8Weight``'s, converted as it loads), m <= MAX_ROWS.
    Never None: cuBLAS cannot take the weight.

    One row: the 16-bit entry where the table has one (the same tiles stream half the
    bytes), else the 16-bit heuristic, with BLOCK_K doubled where the fp32 tile stays
    within the 8192 values of the 16-bit sweep's largest and each split keeps a chunk: a
    16-byte load then holds 16 values, as it holds 8 of a 16-bit W.

    More rows (``tl.dot``, the W tile converted to x's dtype in registers): the 16-bit
    entries ran the fp8 product up to twice slower than these rules, which
    ``bench/fp8_linear.py --sweep`` found fastest on an H200 at 4 and 16 rows of Qwen3-8B's
    projections: BLOCK_N 64 where that alone gives two programs per SM, with BLOCK_K 128;
    else BLOCK_N 32, BLOCK_K 256 up to 4 rows, 512 above; two splits along K."""
    if m > 1:
        block_n = 64 if _cdiv(n, 64) >= 2 * num_sms else 32
        block_k = 128 if block_n == 64 else 256 if m <= 4 else 512
        block_k = max(16, min(block_k, _next_power_of_2(k)))
        split_k = 2 if _cdiv(k, block_k) >= 4 else 1
        return GemvConfig(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4,
                          num_stages=4)
    per_m = (_current() if table is None else table).get((n, k))
    config = _tuned(m, per_m) if per_m and min(per_m) <= MAX_ROWS else None
    if config is None:
        config = default_config(m, n, k, 2, num_sms)
    block_k = config["BLOCK_K"]
    if (config["BLOCK_N"] * block_k * 2 <= 8192 and block_k * 2 <= _next_power_of_2(k)
            and _cdiv(k, 2 * block_k) >= config["SPLIT_K"]):
        config = GemvConfig(**{**config, "BLOCK_K": 2 * block_k})
    return config
