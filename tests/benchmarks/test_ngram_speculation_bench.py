"""bench/ngram_speculation.py end to end on CPU, shortened: it runs both engines and both
transformers paths, checks the speculative tokens against the plain ones, and writes its
table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BENCH = Path(__file__).resolve().parents[2] / "bench" / "ngram_speculation.py"


def test_short_run_writes_rows(tmp_path):
    out = tmp_path / "ngram.json"
    run = subprocess.run([sys.executable, str(BENCH), "--batch-sizes", "1", "--output-len", "24",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| batch | ATOM tok/s | ATOM ngram tok/s |" in run.stdout
    [row] = json.loads(out.read_text())["rows"]
    assert row["batch"] == 1 and row["atom_tok_s"] > 0 and row["hf_lookup_tok_s"] > 0
    assert row["tokens_per_forward"] >= 1.0
