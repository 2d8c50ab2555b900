"""eager_inputs against the per-token definition: ids, positions, cache slots, metadata and
sampled rows of a step mixing decodes, a chunked prefill and prompts with cached prefixes;
every field 16-byte aligned in its one buffer."""

from __future__ import annotations

import random

import torch

from atom_core.engine.step_inputs import eager_inputs


def reference(token_rows, starts, counts, tables, bs):
    ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
    for row, start, n, table in zip(token_rows, starts, counts, tables):
        for p in range(start, start + n):
            ids.append(row[p])
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
    width = 16  # every table here is shorter: padded to the next multiple of 16
    return ids, positions, slots, qsl, seq_lens, [t + [-1] * (width - len(t)) for t in tables]


def test_matches_the_per_token_definition():
    rng = random.Random(0)
    bs = 4
    starts, counts = [9, 0, 17, 5, 30], [1, 13, 1, 11, 3]  # decodes, a prompt, extends
    token_rows, tables, free = [], [], list(range(100))
    rng.shuffle(free)
    for start, n in zip(starts, counts):
        token_rows.append([rng.randrange(1000) for _ in range(start + n + rng.randrange(3))])
        tables.append([free.pop() for _ in range(-(-(start + n) // bs))])
    got = eager_inputs(token_rows, starts, counts, tables, bs, torch.device("cpu"),
                       sample=[0, 2, 4], fill=([0, 3], [3, 1]))
    ids, pos, meta = got.input_ids, got.positions, got.meta
    r_ids, r_pos, r_slots, r_qsl, r_lens, r_tables = reference(
        token_rows, starts, counts, tables, bs)
    assert ids.tolist() == r_ids and pos.tolist() == r_pos
    assert meta.slot_mapping.tolist() == r_slots and meta.slot_mapping.dtype == torch.long
    assert meta.query_start_loc.tolist() == r_qsl and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == r_lens and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == r_tables and meta.block_tables.dtype == torch.int32
    assert meta.query_start_loc_cpu == r_qsl and meta.seq_lens_cpu == r_lens
    assert meta.max_query_len == 13 and meta.max_seq_len == 33 and not meta.is_decode_only
    assert ids.dtype == pos.dtype == torch.long
    assert got.sample_rows.tolist() == [r_qsl[1] - 1, r_qsl[3] - 1, r_qsl[5] - 1]
    assert got.fill_rows.tolist() == [r_qsl[1] - 1, r_qsl[4] - 1]
    assert got.fill_from.tolist() == [3, 1]
    fields = [ids, pos, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables,
              got.sample_rows, got.fill_rows, got.fill_from]
    # One buffer (one copy to the device), each field on a 16-byte boundary: Triton compiles
    # a kernel variant per pointer alignment, and the fields' lengths (odd here) vary.
    assert len({f.untyped_storage().data_ptr() for f in fields}) == 1
    assert all(f.data_ptr() % 16 == 0 for f in fields)


def test_without_ids():
    got = eager_inputs(None, [0], [10], [[7, 3, 5]], 4, torch.device("cpu"))
    assert got.input_ids is None and got.positions.tolist() == list(range(10))
    assert got.sample_rows.numel() == 0 and got.fill_rows.numel() == 0
    assert got.meta.slot_mapping.tolist() == [28, 29, 30, 31, 12, 13, 14, 15, 20, 21]


def test_block_table_width_is_a_multiple_of_16():
    """The width is the tables' row stride, a kernel argument that Triton specialises on
    divisibility by 16 (and on being 1): padded, every step's tables compile one variant."""
    for longest, width in ((1, 16), (15, 16), (16, 16), (17, 32), (70, 80)):
        tables = [[5] * longest, [3]]
        meta = eager_inputs(None, [0, 0], [2, 2], tables, 4, torch.device("cpu")).meta
        assert meta.block_tables.shape == (2, width) and meta.block_tables.stride(0) == width
        assert meta.block_tables[0].tolist() == [5] * longest + [-1] * (width - longest)
        assert meta.block_tables[1].tolist() == [3] + [-1] * (width - 1)
