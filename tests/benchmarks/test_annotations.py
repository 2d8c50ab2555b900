"""Step labels (prefill/decode, FLOP aggregates), annotate() under a profiler,
ATOM_PROFILER_TIMEOUT."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from atom_core.engine.annotations import annotate, profiler_timeout, step_label
from atom_core.errors import ConfigError


@dataclass
class Seq:
    num_prompt_tokens: int
    num_computed_tokens: int


@dataclass
class Batch:
    seqs: list[Seq] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)


def test_decode_label_and_flop_aggregates():
    # Two decodes: q_len 1 each, kv_len = computed + 1.
    batch = Batch([Seq(10, 12), Seq(5, 5)], [1, 1])
    assert step_label(batch, detailed=False) == "decode[bs=2 tok=2]"
    assert step_label(batch, detailed=True) == "decode[bs=2 tok=2 sqsq=2 sqsk=19 sk=19]"


def test_prefill_label_covers_chunks_and_mixed_steps():
    # A fresh 8-token prompt, the second 4-token chunk of a 12-token prompt, and a decode.
    batch = Batch([Seq(8, 0), Seq(12, 8), Seq(3, 6)], [8, 4, 1])
    sqsq = 8 * 8 + 4 * 4 + 1
    sqsk = 8 * 8 + 4 * 12 + 1 * 7
    expected = f"prefill[bs=3 tok=13 sqsq={sqsq} sqsk={sqsk} sk={8 + 12 + 7}]"
    assert step_label(batch, detailed=True) == expected
    # A one-token last prompt chunk is still prefill.
    assert step_label(Batch([Seq(5, 4)], [1]), detailed=False) == "prefill[bs=1 tok=1]"


def test_env_switches_detail(monkeypatch):
    batch = Batch([Seq(4, 0)], [4])
    monkeypatch.delenv("ATOM_ENABLE_DETAILED_ANNOTATION", raising=False)
    assert "sqsq" not in step_label(batch)
    monkeypatch.setenv("ATOM_ENABLE_DETAILED_ANNOTATION", "1")
    assert step_label(batch) == "prefill[bs=1 tok=4 sqsq=16 sqsk=16 sk=4]"


def test_annotate_records_under_a_profiler_and_is_free_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_ENABLE_DETAILED_ANNOTATION", "1")
    batch = Batch([Seq(4, 0)], [4])
    calls = []
    monkeypatch.setattr("atom_core.engine.annotations.step_label",
                        lambda b: calls.append(b) or "prefill[x]")
    with annotate(batch):  # no profiler: the label is never built
        torch.ones(2) + 1
    assert calls == []
    monkeypatch.undo()
    monkeypatch.setenv("ATOM_ENABLE_DETAILED_ANNOTATION", "1")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with annotate(batch):
            torch.ones(4) @ torch.ones(4)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert "prefill[bs=1 tok=4 sqsq=16 sqsk=16 sk=4]" in names


def test_profiler_timeout(monkeypatch):
    monkeypatch.delenv("ATOM_PROFILER_TIMEOUT", raising=False)
    assert profiler_timeout() == 300.0
    monkeypatch.setenv("ATOM_PROFILER_TIMEOUT", "1200")
    assert profiler_timeout() == 1200.0
    for bad in ("soon", "0", "-5"):
        monkeypatch.setenv("ATOM_PROFILER_TIMEOUT", bad)
        with pytest.raises(ConfigError):
            profiler_timeout()
