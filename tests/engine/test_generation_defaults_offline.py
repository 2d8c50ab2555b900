"""--generation-config offline: ``LLMEngine.get_default_sampling_params`` resolves the model's
defaults as the server does, ``generate`` with no SamplingParams samples with them, and
``atom generate`` / ``atom chat`` put their flags over them field by field."""

from __future__ import annotations

import argparse
import io
import json
import sys

import pytest
import torch

from atom_core.engine.llm_engine import LLMEngine
from atom_core.entrypoints import generate_cmd
from atom_core.entrypoints.cli import main
from atom_core.sampling_params import SamplingParams
from atom_core.testing.tiny_models import tiny_model_dir

TINY = str(tiny_model_dir("llama"))  # its generation_config.json: temperature 0.7, top_p 0.9
TINY_FLAGS = ["--model", TINY, "--device", "cpu", "--no-enable-log-stats"]


def tiny(setting: str = "auto") -> LLMEngine:
    return LLMEngine(TINY, enable_log_stats=False, device="cpu", generation_config=setting)


@pytest.fixture(scope="module")
def smollm2(smollm2_engine):
    return smollm2_engine  # tests/conftest.py's, shared with test_smollm2.py


def cli_params(engine: LLMEngine, *flags: str) -> SamplingParams:
    parser = argparse.ArgumentParser()
    generate_cmd.add_sampling_args(parser)
    return generate_cmd.sampling_params(parser.parse_args(list(flags)), engine)


def test_auto_reads_the_model_file_and_none_or_vllm_ignore_it():
    assert tiny().get_default_sampling_params() == SamplingParams(temperature=0.7, top_p=0.9)
    for setting in ("none", "vllm"):
        assert tiny(setting).get_default_sampling_params() == SamplingParams()


def test_a_folder_replaces_the_model_file(tmp_path):
    content = {"temperature": 0.3, "top_k": 5, "max_new_tokens": 9}
    (tmp_path / "generation_config.json").write_text(json.dumps(content))
    params = tiny(str(tmp_path)).get_default_sampling_params()
    assert params == SamplingParams(temperature=0.3, top_k=5, max_tokens=9)


@pytest.mark.slow
def test_the_embedded_model_gets_its_model_cards_sampling(smollm2):
    params = smollm2.get_default_sampling_params()
    assert params == SamplingParams(temperature=0.2, top_p=0.9)
    params.temperature = 1.0  # each call's is new: a caller may change it
    assert smollm2.get_default_sampling_params().temperature == 0.2


@pytest.mark.slow
def test_generate_without_params_samples_with_the_defaults(smollm2):
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "Tell me a joke."}])

    def tokens(params: SamplingParams | None = None) -> list[int]:
        torch.manual_seed(0)  # unseeded requests draw from torch's global generator
        [out] = smollm2.generate(prompt, params)
        return out["token_ids"]

    default = tokens()
    assert default == tokens(SamplingParams(temperature=0.2, top_p=0.9))
    assert default != tokens(SamplingParams())  # what generate used before: temperature 1
    assert default != tokens(SamplingParams(temperature=0.0))  # it samples: not greedy


@pytest.mark.slow
def test_cli_flags_win_field_by_field_over_the_model(smollm2):
    def fields(*flags: str) -> tuple[float, float, int]:
        p = cli_params(smollm2, *flags)
        return p.temperature, p.top_p, p.max_tokens

    assert fields() == (0.2, 0.9, 128)  # the file sets no max_new_tokens: the CLI's 128
    assert fields("--temperature", "0.5", "--max-tokens", "7") == (0.5, 0.9, 7)
    assert fields("--top-p", "1") == (0.2, 1.0, 128)  # given at the fallback's value, still wins


def test_cli_without_model_defaults_is_greedy(tmp_path):
    p = cli_params(tiny("none"))
    assert (p.temperature, p.top_p, p.max_tokens) == (0.0, 1.0, 128)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 5,
                                                                 "max_new_tokens": 9}))
    p = cli_params(tiny(str(tmp_path)), "--max-tokens", "3")
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 5, 3)


def test_atom_generate_and_atom_chat_sample_with_the_defaults(monkeypatch, capsys):
    seen: list[SamplingParams] = []
    monkeypatch.setattr(generate_cmd, "stream",
                        lambda engine, prompt, params, out, stop=None: (seen.append(params)
                                                                        or ("", "stop")))
    assert main(["generate", "Hi", *TINY_FLAGS, "--top-p", "0.5"]) == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    assert main(["chat", *TINY_FLAGS]) == 0
    capsys.readouterr()
    generated, chatted = seen
    assert (generated.temperature, generated.top_p, generated.max_tokens) == (0.7, 0.5, 128)
    assert (chatted.temperature, chatted.top_p, chatted.max_tokens) == (0.7, 0.9, 128)
