"""Prompt samplers, on the tiny byte-level tokenizer and small local files."""

from __future__ import annotations

import argparse
import json

import pytest

from atom_core.benchmarks.cli_args import add_cli_args
from atom_core.benchmarks.datasets import (
    SONNET_PATH,
    get_samples,
    sample_burstgpt_requests,
    sample_hf_requests,
    sample_random_requests,
    sample_sharegpt_requests,
    sample_sonnet_requests,
)
from atom_core.testing.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def n_tokens(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def test_random_lengths_prefix_and_range(tok):
    reqs = sample_random_requests(tok, 50, input_len=40, output_len=20, range_ratio=0.5,
                                  prefix_len=16, seed=3)
    assert len(reqs) == 50
    for r in reqs:
        assert r.prompt_len == n_tokens(tok, r.prompt)
        # The byte round trip may be off by a token or two.
        assert 16 + 20 <= r.prompt_len <= 16 + 40 + 2
        assert 10 <= r.expected_output_len <= 20
        # No special tokens.
        assert not any(s in r.prompt for s in ("<|im_start|>", "<|endoftext|>"))
    heads = {tok.encode(r.prompt, add_special_tokens=False)[:8].__repr__() for r in reqs}
    assert len(heads) == 1  # the shared prefix
    assert len({r.expected_output_len for r in reqs}) > 1
    fixed = sample_random_requests(tok, 5, input_len=30, output_len=7, seed=3)
    assert {r.expected_output_len for r in fixed} == {7}
    again = sample_random_requests(tok, 5, 30, 7, seed=3)
    assert [r.prompt for r in fixed] == [r.prompt for r in again]


def test_random_with_chat_template_counts_the_template(tok):
    [r] = sample_random_requests(tok, 1, input_len=60, output_len=4, use_chat_template=True)
    assert r.prompt.startswith("<|im_start|>user\n") and r.raw_prompt in r.prompt
    assert abs(r.prompt_len - 60) <= 3


def test_sharegpt_pairs_and_pruning(tok, tmp_path):
    rows = [
        {"conversations": [{"from": "human", "value": "Tell me a story about a dragon."},
                           {"from": "gpt", "value": "Once upon a time there was a dragon."}]},
        {"conversations": [{"from": "human", "value": "Hi"},  # too short
                           {"from": "gpt", "value": "Hello there!"}]},
        {"conversations": [{"from": "human", "value": "Only one turn"}]},
        {"conversations": [{"from": "human", "value": "Explain paged attention."},
                           {"from": "gpt", "value": "It stores the KV cache in blocks."}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows))
    reqs = sample_sharegpt_requests(str(path), 2, tok)
    assert sorted(r.prompt for r in reqs) == ["Explain paged attention.",
                                              "Tell me a story about a dragon."]
    for r in reqs:
        assert r.expected_output_len > 4
    fixed = sample_sharegpt_requests(str(path), 2, tok, output_len=9)
    assert {r.expected_output_len for r in fixed} == {9}
    with pytest.raises(ValueError, match="fewer than"):
        sample_sharegpt_requests(str(path), 3, tok)
    with pytest.raises(ValueError, match="--dataset-path"):
        sample_sharegpt_requests(None, 1, tok)


def test_burstgpt_lengths_from_gpt4_rows(tok, tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "0,ChatGPT,10,5,15,Conversation log\n"
                    "1,GPT-4,24,12,36,Conversation log\n"
                    "2,GPT-4,30,0,30,Conversation log\n")
    reqs = sample_burstgpt_requests(str(path), 3, tok)
    assert [(r.prompt_len, r.expected_output_len) for r in reqs] == [(24, 12)] * 3


def test_sonnet_prefix_and_template(tok):
    assert SONNET_PATH.stat().st_size < 20_000
    assert SONNET_PATH.read_text().splitlines()[28] == "Shall I compare thee to a summer's day?"
    reqs = sample_sonnet_requests(tok, 4, input_len=550, output_len=30, prefix_len=200)
    for r in reqs:
        assert r.prompt.startswith(
            "<|im_start|>user\nPick as many lines as you can from these poem lines:\n")
        assert r.prompt_len == n_tokens(tok, r.prompt)
        assert 400 <= r.prompt_len <= 700 and r.expected_output_len == 30
    assert len({r.raw_prompt.splitlines()[1] for r in reqs}) == 1  # the shared prefix lines


def test_hf_needs_a_local_copy(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="local copy"):
        sample_hf_requests("some-org/some-dataset", 1, tok)
    pytest.importorskip("datasets")
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"What is {i} plus {i}?",
                                          "answer": f"It is {2 * i}."})
                              for i in range(10, 16)))
    reqs = sample_hf_requests(str(path), 4, tok)
    assert len(reqs) == 4 and all(r.prompt.startswith("What is") for r in reqs)
    assert all(r.expected_output_len == n_tokens(tok, f"It is {2 * int(r.prompt.split()[2])}.")
               for r in reqs)


def test_get_samples_from_cli_defaults(tok):
    args = add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--model", "m", "--dataset-name", "random", "--random-input-len", "20",
         "--random-output-len", "5", "--num-prompts", "3"])
    assert [r.expected_output_len for r in get_samples(args, tok)] == [5, 5, 5]
    defaults = add_cli_args(argparse.ArgumentParser()).parse_args(["--model", "m"])
    assert (defaults.backend, defaults.dataset_name, defaults.num_prompts,
            defaults.request_rate) == ("vllm", "sharegpt", 1000, float("inf"))
    assert (defaults.random_input_len, defaults.random_output_len, defaults.random_range_ratio,
            defaults.random_prefix_len, defaults.burstiness, defaults.percentile_metrics,
            defaults.metric_percentiles, defaults.seed, defaults.port, defaults.host) == (
        1024, 128, 1.0, 0, 1.0, "ttft,tpot,itl", "99", 0, 8000, "127.0.0.1")
