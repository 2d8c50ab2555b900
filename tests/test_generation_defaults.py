"""--generation-config: which defaults each setting gives, how a request's own fields win over
them, and the chat and completions routes applying them."""

from __future__ import annotations

import json

import pytest

from atom_core.config import Config
from atom_core.errors import ConfigError
from atom_core.generation_defaults import EMBEDDED_DEFAULTS, GenerationDefaults
from atom_core.loader import embedded_model_path
from atom_core.sampling_params import SamplingParams
from atom_core.testing.tiny_models import tiny_model_dir
from tests.entrypoints.http.asgi_app import make_app, post
from tests.entrypoints.http.fake_engine import USER, FakeEngineClient

MODEL_FILE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
              "repetition_penalty": 1.1, "max_new_tokens": 40, "do_sample": True,
              "eos_token_id": 2}
MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                  "repetition_penalty": 1.1, "max_tokens": 40}


def folder(tmp_path, content) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(content))
    return str(tmp_path)


def test_auto_reads_the_model_directory():
    defaults = GenerationDefaults.resolve("auto", str(tiny_model_dir("llama")))
    assert dict(defaults.values) == {"temperature": 0.7, "top_p": 0.9}  # what it saved


def test_every_field_read_and_max_new_tokens_is_max_tokens(tmp_path):
    defaults = GenerationDefaults.resolve("auto", folder(tmp_path, MODEL_FILE))
    assert dict(defaults.values) == MODEL_DEFAULTS
    assert "generation_config.json" in defaults.describe()


def test_a_folder_replaces_the_model_file(tmp_path):
    setting = folder(tmp_path, {"temperature": 0.3, "top_k": 5})
    defaults = GenerationDefaults.resolve(setting, str(tiny_model_dir("llama")))
    assert dict(defaults.values) == {"temperature": 0.3, "top_k": 5}
    assert Config.from_kwargs(generation_config=setting).model_config.generation_config == setting


@pytest.mark.parametrize("setting", ["none", "vllm"])
def test_none_and_vllm_ignore_the_model(setting):
    assert not GenerationDefaults.resolve(setting, str(tiny_model_dir("llama"))).values
    assert not GenerationDefaults.resolve(setting, None).values


def test_a_model_without_a_file_keeps_the_api_defaults(tmp_path):
    assert not GenerationDefaults.resolve("auto", str(tmp_path)).values


def test_the_embedded_model_gets_its_model_cards_sampling():
    assert EMBEDDED_DEFAULTS == {"temperature": 0.2, "top_p": 0.9}
    assert dict(GenerationDefaults.resolve("auto", None).values) == EMBEDDED_DEFAULTS
    named = GenerationDefaults.resolve("auto", str(embedded_model_path()))
    assert dict(named.values) == EMBEDDED_DEFAULTS


def test_unset_fields_take_the_defaults_and_set_ones_win():
    defaults = GenerationDefaults(MODEL_DEFAULTS)
    given = SamplingParams(temperature=1.0, top_k=-1, max_tokens=256)
    params = defaults.apply(given, {"temperature", "messages"})
    assert params.temperature == 1.0  # sent, even at the API's default value
    assert (params.top_p, params.top_k, params.min_p) == (0.95, 20, 0.05)
    assert params.repetition_penalty == 1.1 and params.max_tokens == 40
    for sent in ("max_tokens", "max_completion_tokens"):
        assert defaults.apply(given, {sent}).max_tokens == 256
    assert GenerationDefaults().apply(given, set()) is given


@pytest.mark.parametrize(
    "content,message",
    [
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_k": 2.5}, "top_k must be a number (an integer)"),
        ({"max_new_tokens": 0}, "max_tokens must be in"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_a_bad_file_is_one_config_error(tmp_path, content, message):
    setting = folder(tmp_path, content)
    with pytest.raises(ConfigError, match="generation_config.json") as err:
        Config.from_kwargs(generation_config=setting)
    assert message in str(err.value)


def test_a_folder_without_the_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no generation_config.json there"):
        Config.from_kwargs(generation_config=str(tmp_path))
    with pytest.raises(ConfigError, match="no such folder"):
        Config.from_kwargs(generation_config=str(tmp_path / "missing"))


# ------------------------------------------------------------- through the HTTP routes


def test_the_routes_fill_what_a_request_leaves_out():
    engine = FakeEngineClient()
    app = make_app(engine, defaults=GenerationDefaults(MODEL_DEFAULTS))
    assert post(app, "/v1/chat/completions", {"messages": USER}).status_code == 200
    assert post(app, "/v1/chat/completions", {
        "messages": USER, "temperature": 1.0, "top_p": None, "max_completion_tokens": 7,
    }).status_code == 200
    assert post(app, "/v1/completions", {"prompt": "Hi", "top_k": 3}).status_code == 200
    plain, own, completion = (params for _, params, _ in engine.calls)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (0.6, 0.95, 20, 40)
    # A null counts as left out; a value, even the API's default, is the request's.
    assert (own.temperature, own.top_p, own.top_k, own.max_tokens) == (1.0, 0.95, 20, 7)
    assert (completion.temperature, completion.top_k, completion.max_tokens) == (0.6, 3, 40)


def test_anthropic_messages_fill_what_a_request_leaves_out():
    engine = FakeEngineClient()
    app = make_app(engine, defaults=GenerationDefaults(MODEL_DEFAULTS))
    body = {"model": "fake-model", "messages": USER, "max_tokens": 5, "top_k": 3}
    assert post(app, "/v1/messages", body).status_code == 200
    [(_, params, _)] = engine.calls
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 3)
    assert (params.min_p, params.repetition_penalty, params.max_tokens) == (0.05, 1.1, 5)
