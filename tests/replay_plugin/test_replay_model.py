"""ReplayForCausalLM on hand-made batches: the script follows each sequence's prompt, EOS
after it, and a rewritten script file is read when the next sequence starts."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from atom_core.layers.attention.metadata import AttentionMetadata
from atom_core.layers.context import forward_context
from tests.replay_plugin.atom_replay_model.checkpoint import write_script
from tests.replay_plugin.atom_replay_model.model import ReplayForCausalLM

EOS = 9
BLOCK = 4


def model_for(**config) -> ReplayForCausalLM:
    cfg = SimpleNamespace(vocab_size=16, eos_token_id=[EOS], **config)
    model = ReplayForCausalLM(cfg)
    model.attn.kv_cache = torch.zeros(model.attn.kv_cache_shape(8, BLOCK))
    return model


def step(model: ReplayForCausalLM, seqs: list[tuple[list[int], int, list[int]]]) -> list[int]:
    """One forward over (token ids, start position, block table) per sequence; the
    argmax of each sequence's last row."""
    ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
    for tokens, start, table in seqs:
        for j, t in enumerate(tokens):
            p = start + j
            ids.append(t)
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        qsl.append(qsl[-1] + len(tokens))
        seq_lens.append(start + len(tokens))
    width = max(len(t) for _, _, t in seqs)
    tables = [t + [-1] * (width - len(t)) for _, _, t in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        block_size=BLOCK, max_query_len=max(len(s[0]) for s in seqs), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    with torch.inference_mode(), forward_context(meta):
        hidden = model(torch.tensor(ids), torch.tensor(positions))
        logits = model.compute_logits(hidden[[q - 1 for q in qsl[1:]]])
    return logits.argmax(-1).tolist()


def test_two_sequences_replay_their_scripts_then_eos(tmp_path):
    script = tmp_path / "script.json"
    write_script(script, [3, 4, 5])
    model = model_for(replay_script=str(script))
    a = step(model, [([1, 2, 1, 2, 1], 0, [0, 1])])  # prefill, 5 tokens
    write_script(script, [7, 8])  # the next sequence replays the new script
    b = step(model, [([1, 1], 0, [2])])
    assert (a, b) == ([3], [7])
    # both decode in one batch, each on its own script
    assert step(model, [([3], 5, [0, 1]), ([7], 2, [2])]) == [4, 8]
    assert step(model, [([4], 6, [0, 1]), ([8], 3, [2])]) == [5, EOS]
    assert step(model, [([5], 7, [0, 1])]) == [EOS]


def test_inline_token_ids_and_a_chunked_prefill():
    model = model_for(replay_token_ids=[6, 6, 7])
    assert step(model, [([1, 2, 3, 4], 0, [0, 1])]) == [6]  # first chunk...
    # ...the prompt grew: the script restarts after it.
    assert step(model, [([5, 6], 4, [0, 1])]) == [6]
    assert step(model, [([6], 6, [0, 1])]) == [6]
    assert step(model, [([6], 7, [0, 1])]) == [7]
