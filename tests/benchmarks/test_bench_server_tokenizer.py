"""`atom bench serve` against the default server (the embedded SmolLM2) with no --tokenizer.

The benchmark builds and counts its prompts with the server's own tokenizer, through
/tokenize and /detokenize; those count exactly what the server's generation routes count
(checked here against their usage, through the openai and anthropic SDKs). Failed
requests' errors are printed after the block, and nothing the benchmark asks puts a 404
in the server's log (its access log is on)."""

from __future__ import annotations

import contextlib
import io
import json

import anthropic
import httpx
import openai
import pytest

from atom_core.benchmarks import benchmark_serving

pytestmark = pytest.mark.slow

TEXT = "Paged attention keeps the KV cache in blocks. 你好，世界 🦊"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is paged attention?"}]


@pytest.fixture(scope="module")
def log_start(smollm2_server) -> int:
    """Where this module's requests begin in the session server's access log."""
    return len(smollm2_server.log_path.read_text())


@pytest.fixture(scope="module")
def server(smollm2_server, log_start):
    """The session's default server (tests/conftest.py), its log offset taken first."""
    return smollm2_server


@pytest.fixture(scope="module")
def model(server) -> str:
    [card] = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    return card["id"]


def tokenize(server, **body) -> dict:
    r = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def detokenize(server, tokens: list[int]) -> str:
    r = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_tokenize_counts_what_the_generation_routes_count(server, model):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
    ids = tokenize(server, model=model, messages=MESSAGES)["tokens"]
    assert chat.usage.prompt_tokens == len(ids)
    # The rendered prompt round-trips: its text tokenizes back to the same ids.
    text = detokenize(server, ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert tokenize(server, prompt=text, add_special_tokens=False)["tokens"] == ids

    done = client.completions.create(model=model, prompt=TEXT, max_tokens=1)
    plain = tokenize(server, prompt=TEXT)
    assert done.usage.prompt_tokens == plain["count"] and plain["max_model_len"] == 512
    assert detokenize(server, plain["tokens"]) == TEXT


def test_count_tokens_is_the_input_tokens_of_the_message(server, model):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
             {"role": "user", "content": "What is paged attention?"}]
    kw = dict(model=model, system="Be brief.", messages=turns)
    counted = client.messages.count_tokens(**kw).input_tokens
    assert counted == client.messages.create(max_tokens=1, **kw).usage.input_tokens > 0


def bench(server, *flags: str) -> tuple[int, str]:
    """``atom bench serve`` with no --tokenizer: its exit status and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = benchmark_serving.main(["--base-url", server.base_url, "--disable-tqdm", *flags])
    return status, out.getvalue()


@pytest.fixture(scope="module")
def runs(server, model, tmp_path_factory):
    """Two runs: random prompts on /v1/completions, and sonnet prompts (the chat template
    applied through the server) on /v1/chat/completions."""
    results = {}
    for name, flags in {
        "random": ("--dataset-name", "random", "--num-prompts", "4", "--random-input-len", "24",
                   "--random-output-len", "3", "--random-range-ratio", "0.5"),
        "sonnet": ("--backend", "openai-chat", "--dataset-name", "sonnet", "--num-prompts", "2",
                   "--sonnet-input-len", "80", "--sonnet-prefix-len", "50",
                   "--sonnet-output-len", "2"),
    }.items():
        where = tmp_path_factory.mktemp(name)
        status, printed = bench(server, "--model", model, *flags, "--save-result",
                                "--result-dir", str(where), "--result-filename", "r.json")
        results[name] = status, printed, json.loads((where / "r.json").read_text())
    return results


@pytest.mark.parametrize("name", ["random", "sonnet"])
def test_bench_without_a_tokenizer_uses_the_servers(runs, server, name):
    status, printed, res = runs[name]
    assert status == 0, printed
    assert "============ Serving Benchmark Result ============" in printed
    assert res["completed"] == res["num_prompts"] and res["failed"] == 0
    assert res["tokenizer_id"] == f"{server.base_url}/tokenize"
    # The prompts were counted with the server's own tokenizer: its counts, exactly.
    assert res["tokenizer_input_lens"] == res["server_input_lens"]
    assert "Failed requests" not in printed


def test_failed_requests_print_their_first_errors(server, model):
    status, printed = bench(server, "--model", model, "--dataset-name", "random",
                            "--num-prompts", "3", "--random-input-len", "8",
                            "--random-output-len", "2", "--logprobs", "21")
    lines = printed.splitlines()
    end = lines.index("=" * 50)
    assert lines[end + 1] == "Failed requests: 3 (1 distinct errors, all shown)"
    assert lines[end + 2].startswith("     3 x HTTP 400: ") and "logprobs" in lines[end + 2]
    assert status == 1 and "every one of the 3 requests" in lines[-1]


def test_nothing_the_benchmark_asks_is_a_404(runs, server, log_start):
    log = server.log_path.read_text()[log_start:]
    requests = [line for line in log.splitlines() if '" ' in line and "HTTP/1.1" in line]
    assert any('"GET /debug/mtp_stats HTTP/1.1" 200' in line for line in requests)
    assert any('"POST /tokenize HTTP/1.1" 200' in line for line in requests)
    assert any('"POST /detokenize HTTP/1.1" 200' in line for line in requests)
    assert not [line for line in requests if '" 404' in line]
