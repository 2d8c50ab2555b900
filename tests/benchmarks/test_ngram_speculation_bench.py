"""bench/ngram_speculation.py end to end on CPU, shortened, in this process (transformers'
model is the session's, whose GGUF load is the run's longest part): it runs both engines
and both transformers paths, checks the speculative tokens against the plain ones, and
writes its table and JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import ngram_speculation  # noqa: E402


def test_short_run_writes_rows(tmp_path, hf_smollm2, monkeypatch, capsys):
    from transformers import AutoTokenizer

    from atom_core.loader import embedded_model_path

    path = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    monkeypatch.setattr(ngram_speculation, "hf_model", lambda: (tok, hf_smollm2))
    out = tmp_path / "ngram.json"
    monkeypatch.setattr(ngram_speculation, "ARGS", argparse.Namespace(
        batch_sizes=[1], output_len=12, k=4, json=str(out)), raising=False)
    threads = torch.get_num_threads()
    try:
        ngram_speculation.main()
    finally:
        torch.set_num_threads(threads)
    assert "| batch | ATOM tok/s | ATOM ngram tok/s |" in capsys.readouterr().out
    [row] = json.loads(out.read_text())["rows"]
    assert row["batch"] == 1 and row["atom_tok_s"] > 0 and row["hf_lookup_tok_s"] > 0
    assert row["tokens_per_forward"] >= 1.0
