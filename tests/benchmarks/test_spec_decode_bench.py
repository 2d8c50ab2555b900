"""bench/spec_decode.py on CPU: the configs it writes (an MTP layer declared on the target, an
EAGLE-3 head in the published layout), the forced lengths, graph sizes, stats deltas and
target verdicts it works with, and, shortened on tiny models, its whole per-setup run (plain
engine, speculative engines at k = 1 and 3, profiles, report)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from atom_core.spec_decode.stats import SpecDecodeStats
from atom_core.testing.tiny_models import tiny_config, tiny_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import common  # noqa: E402
import spec_decode as bench  # noqa: E402


def test_mtp_target_declares_one_layer_and_keeps_the_rest():
    shipped = common.load_config("deepseek-v2-lite")
    cfg = bench.with_mtp_layers(shipped, 1)
    assert cfg["num_nextn_predict_layers"] == 1
    assert "num_nextn_predict_layers" not in shipped
    assert {k: v for k, v in cfg.items() if k != "num_nextn_predict_layers"} == shipped


def test_eagle3_draft_config_is_the_published_layout_of_the_targets_shape():
    target = common.load_config("qwen3-8b")
    cfg = bench.eagle3_draft_config(target)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                "vocab_size"):
        assert cfg[key] == target[key], key
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 32000
    assert cfg["tie_word_embeddings"] is False
    # A transformers 5 config names the RoPE base under rope_parameters; the draft is clamped
    # to a small target vocabulary.
    small = bench.eagle3_draft_config(tiny_config("qwen3").to_dict())
    assert small["rope_theta"] == 1e6 and small["head_dim"] == 32
    assert small["draft_vocab_size"] == small["vocab_size"] == 272


def test_eagle3_draft_config_is_read_by_the_plugin(tmp_path):
    eagle3 = pytest.importorskip("atom_models_llama.eagle3")
    path = bench.write_config(tmp_path / "draft",
                              bench.eagle3_draft_config(common.load_config("qwen3-8b"))).parent
    config = eagle3.read_config(path)
    assert config.num_hidden_layers == 1 and config.draft_vocab_size == 32000
    assert config.head_dim == 128 and config.vocab_size == 151936
    assert eagle3.aux_layer_ids(config, 36) == (2, 18, 33)


def test_prepare_writes_what_each_setup_loads(tmp_path):
    mtp = bench.prepare(bench.SETUPS["deepseek-v2-lite+mtp"], tmp_path / "a")
    assert mtp.method == "mtp" and mtp.draft is None
    assert json.loads(mtp.target.read_text())["num_nextn_predict_layers"] == 1
    eagle = bench.prepare(bench.SETUPS["qwen3-8b+eagle3"], tmp_path / "b")
    assert eagle.target == common.config_path("qwen3-8b") and eagle.method == "eagle3"
    assert json.loads((eagle.draft / "config.json").read_text())["draft_vocab_size"] == 32000
    small = bench.prepare(bench.SETUPS["qwen3-8b+qwen3-0.6b"], tmp_path / "c")
    assert small.method == "draft_model"
    assert small.draft == common.config_path("qwen3-0.6b").parent
    assert bench.parse_args([]).setups == ["deepseek-v2-lite+mtp", "qwen3-8b+eagle3"]


def test_lengths_and_graph_sizes():
    assert bench.lengths_for(1, None) == [1.0, 2.0]
    assert bench.lengths_for(3, None) == [1.0, 2.0, 4.0]
    assert bench.lengths_for(3, [5.0, 1.0, 3.5]) == [1.0, 3.5]  # 5 > k + 1
    assert bench.capture_sizes([1, 8, 32], 0) == [1, 8, 32]
    assert bench.capture_sizes([1, 8, 32], 3) == [1, 4, 8, 32, 128]
    assert bench.capture_sizes([64, 128], 3) == [64, 128, 256]  # 512 rows: past the graphs


def test_stats_delta_counts_only_the_run_between_snapshots():
    stats = SpecDecodeStats(3)
    stats.record(3, 0)
    before = stats.as_dict()
    for accepted in (3, 2, 3, 1):
        stats.record(3, accepted)
    delta = bench.stats_delta(before, stats.as_dict())
    assert delta["verifications"] == 4 and delta["draft_tokens"] == 12
    assert delta["tokens_per_forward"] == pytest.approx(1 + 9 / 4)
    assert delta["acceptance_rate"] == pytest.approx(9 / 12)
    assert bench.stats_delta(before, before)["tokens_per_forward"] is None


def row(k, length, batch, ratio):
    return {"k": k, "length": length, "batch": batch, "ratio": ratio}


def test_verdicts_judge_the_two_targets_at_batch_1():
    rows = [row(3, 4.0, 1, 0.39), row(3, 4.0, 8, 0.9), row(3, 1.0, 1, 1.30),
            row(1, 1.0, 1, 1.1), row(1, 2.0, 1, 0.6), row(3, 2.0, 1, 0.5)]
    judged = {(v["k"], v["length"]): v["met"] for v in bench.verdicts(rows)}
    assert judged == {(3, 4.0): True, (3, 1.0): False, (1, 1.0): True}
    assert not bench.verdicts([row(3, 4.0, 1, 0.41)])[0]["met"]
    lines = bench.verdict_lines({"verdicts": bench.verdicts([row(3, 4.0, 1, 0.41)])})
    assert "MISSED" in lines[0] and lines[1].endswith("not measured")


def test_kernel_delta_ranks_kernels_by_time_over_a_plain_step():
    plain = [{"kernel": "gemv", "us_per_step": 100.0, "calls_per_step": 10.0}]
    spec = [{"kernel": "gemv", "us_per_step": 130.0, "calls_per_step": 12.0},
            {"kernel": "argmax", "us_per_step": 5.0, "calls_per_step": 3.0}]
    delta = bench.kernel_delta(spec, plain)
    assert [(d["kernel"], d["us_per_step"], d["calls_per_step"]) for d in delta] == [
        ("gemv", 30.0, 2.0), ("argmax", 5.0, 3.0)]


def test_an_unregistered_method_is_a_reason_to_skip(tmp_path):
    assert bench.unregistered("ngram") is None
    assert "--method no-such-method is not registered" in bench.unregistered("no-such-method")
    models = bench.Models(tmp_path / "config.json", "no-such-method")
    result = bench.bench_models(models, bench.parse_args(["--no-hf"]), None, 1e10)
    assert "not registered" in result["skipped"] and "rows" not in result


@pytest.mark.slow
def test_a_tiny_setup_runs_end_to_end_on_cpu(tmp_path, capsys):
    """EAGLE-3 on tiny Qwen3 (dense: MoE and MLA kernels run in Triton's interpreter here,
    ~0.2 s a token; the MTP setup differs only in the files ``prepare`` writes)."""
    import torch

    args = bench.parse_args(["--k", "1", "3", "--batch-sizes", "1", "2", "--prompt-len", "16",
                             "--output-len", "16", "--no-hf", "--profile", "all"])
    qwen = json.loads((tiny_model_dir("qwen3") / "config.json").read_text())
    models = bench.Models(
        bench.write_config(tmp_path / "qwen", qwen), "eagle3",
        bench.write_config(tmp_path / "eagle3", bench.eagle3_draft_config(qwen)).parent)
    result = bench.bench_models(models, args, torch.device("cpu"), 1e10)
    assert not result["errors"], result["errors"]
    plain = result["plain"]["batches"]
    assert set(plain) == {1, 2} and all(p["tpot_ms"] > 0 for p in plain.values())
    rows = result["rows"]
    assert [(r["k"], r["length"], r["batch"]) for r in rows] == [
        (1, 1.0, 1), (1, 1.0, 2), (1, 2.0, 1), (1, 2.0, 2),
        (3, 1.0, 1), (3, 1.0, 2), (3, 2.0, 1), (3, 2.0, 2), (3, 4.0, 1), (3, 4.0, 2)]
    for r in rows:
        assert r["tokens"] == 16 * r["batch"]
        # The forced length, less where a request's last steps draft fewer.
        assert r["length"] - 0.25 <= r["tokens_per_forward"] <= r["length"], r
        assert r["ratio"] == pytest.approx(r["tpot_ms"] / plain[r["batch"]]["tpot_ms"])
        assert r["limit_ms"] == pytest.approx(plain[r["batch"]]["roofline_ms"] / r["length"])
    assert {(v["k"], v["length"]) for v in result["verdicts"]} == {(3, 4.0), (1, 1.0), (3, 1.0)}
    # --profile all: a plain step, then every judged row.
    assert result["plain"]["profile"]["k"] == 0
    assert [(p["k"], p["length"]) for p in result["profiles"]] == [(1, 1.0), (3, 1.0), (3, 4.0)]
    for prof in result["profiles"]:
        assert prof["kernels"] and prof["wall_ms_per_step"] > 0
        assert prof["tokens_per_forward"] == prof["length"]
        assert any(r["range"].startswith(("prefill[", "decode[")) for r in prof["ranges"])
    bench.report({"setups": {"tiny": result}})
    out = capsys.readouterr().out
    assert "| k | length | batch | ATOM plain TPOT ms | ATOM spec TPOT ms | ratio |" in out
    assert "target k=3, length 4.0, batch 1: <= 0.40x plain: k=3 ratio" in out
    assert "over a plain step:" in out
