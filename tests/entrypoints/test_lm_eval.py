"""lm-eval's ``local-completions`` model end to end against the real server, offline.

Two tiny tasks ship in lm_eval_tasks/ (one generate_until, one multiple_choice) over a
local jsonl. The served model is the tiny random Llama, so accuracy means nothing; what
is checked is the wire format lm-eval depends on: every request answered, generations
come back as strings, and the loglikelihoods lm-eval reads out of echo + logprobs equal
the server's own prompt logprobs and a transformers reference.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from atom_core.entrypoints.server_process import ServerProcess
from atom_core.testing.tiny_models import hf_model, tiny_model_dir

pytestmark = pytest.mark.slow

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
GEN, MC = "atom_capitals_gen", "atom_capitals_mc"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("lm_eval_server")
    srv = ServerProcess(
        tiny_model_dir("llama"), "--max-model-len", "512", "--served-model-name", "tiny",
        log=logs / "server.log",
    ).wait_ready()
    yield srv
    srv.stop()


def task_dir(tmp_path) -> str:
    """The shipped task YAMLs with data_files made absolute and the datasets cache in
    tmp_path, so the run works from any cwd and leaves nothing behind."""
    out = tmp_path / "tasks"
    out.mkdir()
    for src in TASKS_DIR.glob("*.yaml"):
        config = yaml.safe_load(src.read_text())
        kwargs = config["dataset_kwargs"]
        kwargs["data_files"] = {
            split: str(TASKS_DIR / path.rsplit("/", 1)[-1])
            for split, path in kwargs["data_files"].items()
        }
        kwargs["cache_dir"] = str(tmp_path / "datasets-cache")
        (out / src.name).write_text(yaml.safe_dump(config))
    return str(out)


def requests_finished(server) -> float:
    """atom:request_success summed over finish reasons."""
    text = httpx.get(f"{server.base_url}/metrics").text
    counts = re.findall(r"^atom:request_success_total\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(v) for v in counts)


def offline(monkeypatch) -> None:
    """No hub access: the env for anything started later, the flags for what is imported."""
    import datasets
    import huggingface_hub.constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def server_loglikelihood(server, tokenizer, context: str, continuation: str) -> float:
    """Sum of the continuation's prompt logprobs from an echo-only request (max_tokens 0,
    a different path from lm-eval's max_tokens 1), split the way lm-eval splits it."""
    n_ctx = len(tokenizer(context, add_special_tokens=False).input_ids)
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    body = {"model": "tiny", "prompt": whole, "echo": True, "max_tokens": 0, "logprobs": 1}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    token_logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == len(whole)
    return sum(token_logprobs[n_ctx:])


def reference_loglikelihood(tokenizer, context: str, continuation: str) -> float:
    """The same sum from transformers."""
    n_ctx = len(tokenizer(context, add_special_tokens=False).input_ids)
    ids = torch.tensor([tokenizer(context + continuation, add_special_tokens=False).input_ids])
    with torch.no_grad():
        logprobs = hf_model("llama")(ids).logits[0].log_softmax(-1)
    targets = ids[0, n_ctx:]
    return logprobs[n_ctx - 1 : -1].gather(-1, targets[:, None]).sum().item()


def test_local_completions_generate_and_loglikelihood(server, tmp_path, monkeypatch):
    offline(monkeypatch)
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    docs = [json.loads(line) for line in (TASKS_DIR / "capitals.jsonl").read_text().splitlines()]
    model_dir = str(tiny_model_dir("llama"))
    before = requests_finished(server)
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{server.base_url}/v1/completions", "model": "tiny",
            "num_concurrent": 4, "max_retries": 1, "tokenized_requests": False,
            "tokenizer": model_dir, "tokenizer_backend": "huggingface", "max_length": 512,
        },
        tasks=[GEN, MC],
        task_manager=TaskManager(include_path=task_dir(tmp_path), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    assert out is not None
    results, samples = out["results"], out["samples"]
    assert "exact_match,none" in results[GEN]
    assert {"acc,none", "acc_norm,none"} <= set(results[MC])
    assert 0.0 <= results[MC]["acc,none"] <= 1.0

    # One server request per lm-eval request: nothing failed, nothing was retried.
    n_choices = sum(len(d["choices"]) for d in docs)
    assert requests_finished(server) - before == len(docs) + n_choices

    gen = samples[GEN]
    assert len(gen) == len(docs)
    for s in gen:
        [[text]] = s["resps"]
        assert isinstance(text, str) and "\n" not in text  # cut at the task's stop string

    mc = samples[MC]
    assert len(mc) == len(docs)
    for s, doc in zip(sorted(mc, key=lambda s: s["doc_id"]), docs):
        assert len(s["resps"]) == len(doc["choices"])
        for [(ll, greedy)] in s["resps"]:
            assert math.isfinite(ll) and ll < 0 and isinstance(greedy, bool)

    # lm-eval sliced the right tokens out of echo + logprobs: its number equals the
    # server's own prompt logprobs and transformers' for the same context/continuation.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sample = mc[0]
    for args, [(ll, _)] in list(zip(sample["arguments"], sample["resps"]))[:2]:
        context, continuation = args
        served = server_loglikelihood(server, tokenizer, context, continuation)
        assert ll == pytest.approx(served, abs=1e-3)
        reference = reference_loglikelihood(tokenizer, context, continuation)
        assert ll == pytest.approx(reference, abs=1e-3)
