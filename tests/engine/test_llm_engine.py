"""LLMEngine behaviour: stopping, seeds, aborts, streaming, validation; blocks always freed."""

from __future__ import annotations

import random

import pytest

from atom_core.engine.llm_engine import LLMEngine, RequestOutput
from atom_core.errors import InvalidRequestError
from atom_core.sampling_params import SamplingParams
from atom_core.testing.tiny_models import tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def shared_engine():
    return LLMEngine(str(tiny_model_dir("llama")), enable_log_stats=False, device="cpu",
                     enable_prefix_caching=True, max_model_len=256)


@pytest.fixture
def engine(shared_engine):
    yield shared_engine
    assert shared_engine.is_finished()
    assert shared_engine.block_manager.num_free_blocks == shared_engine.runner.num_blocks


def test_output_fields(engine):
    [out] = engine.generate(["Hello world"], GREEDY)
    assert out["num_tokens_output"] == 16 == len(out["token_ids"])
    assert out["num_tokens_input"] == len(engine.tokenize("Hello world"))
    assert out["finish_reason"] == "length"
    assert 0 < out["ttft"] <= out["latency"] and out["tpot"] > 0
    assert out["text"] == engine.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_finished_output_carries_the_engine_timestamps(engine):
    outs: list[RequestOutput] = []
    engine.add_request([[1, 2, 3, 4]], GREEDY, outs.append)
    while not engine.is_finished():
        engine.step()
    assert all(o.timings is None for o in outs[:-1])
    t = outs[-1].timings
    assert t.arrival <= t.scheduled <= t.first_token <= t.second_token <= t.finished
    assert outs[-1].ttft_s == pytest.approx(t.first_token - t.arrival)


def test_stop_token_ids_end_generation(engine):
    [ref] = engine.generate(["The quick brown fox"], GREEDY)
    stop = ref["token_ids"][5]
    first = ref["token_ids"].index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop])
    [out] = engine.generate(["The quick brown fox"], params)
    assert out["token_ids"] == ref["token_ids"][: first + 1]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop)


def test_stop_strings_cut_the_text(engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    [ref] = engine.generate(["Paged attention"], greedy)
    text = ref["text"]
    stop = text[10:13]
    assert stop and stop in text
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_strings=[stop])
    [out] = engine.generate(["Paged attention"], params)
    assert out["text"] == text[: text.index(stop)]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop)


def test_eos_stops_unless_ignored(engine, monkeypatch):
    [ref] = engine.generate(["Hello"], GREEDY)
    eos = ref["token_ids"][6]  # declare a token the model is known to emit as EOS
    monkeypatch.setattr(engine, "eos_token_ids", {eos})
    [out] = engine.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=16))
    assert out["token_ids"] == ref["token_ids"][: ref["token_ids"].index(eos) + 1]
    assert out["finish_reason"] == "stop" and out["stop_reason"] is None
    [ignored] = engine.generate(["Hello"], GREEDY)
    assert ignored["token_ids"] == ref["token_ids"]


def test_seeded_requests_reproduce_across_batch_compositions(engine):
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    alone = engine.generate(["Hello world"], seeded)[0]["token_ids"]
    crowd = engine.generate(["a b c", "Hello world", "The lazy dog sleeps"], [other, seeded, other])
    last = engine.generate(["x", "yy", "zzz", "Hello world"], [other, other, other, seeded])
    assert crowd[1]["token_ids"] == alone == last[3]["token_ids"]
    other_seed = SamplingParams(temperature=1.0, max_tokens=12, seed=99, ignore_eos=True)
    different = engine.generate(["Hello world"], other_seed)
    assert different[0]["token_ids"] != alone


def test_abort_running_request_frees_its_blocks_at_once(engine):
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    keep, drop = engine.add_request(["keep going please", "this one is aborted " * 4], params)
    for _ in range(3):
        engine.step()
    free_before = engine.block_manager.num_free_blocks
    drop_seq = next(s for s in engine.scheduler.running if s.request_id == drop)
    held = len(drop_seq.block_table)
    assert held > 0
    assert engine.abort_request(drop)
    assert engine.block_manager.num_free_blocks == free_before + held
    finished = []
    while not engine.is_finished():
        finished += engine.step()
    assert [s.request_id for s in finished] == [keep]
    assert not engine.abort_request(drop)


def test_abort_waiting_request(engine):
    engine.add_request(["never scheduled"], GREEDY, request_ids=["w1"])
    assert engine.scheduler.num_waiting == 1
    assert engine.abort_request("w1")
    assert engine.is_finished()


def test_stream_callback_deltas_add_up(engine):
    got: list[RequestOutput] = []
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_strings=["zz"])
    [rid] = engine.add_request(["Stream this"], params, stream_callback=got.append)
    while not engine.is_finished():
        engine.step()
    [ref] = engine.generate(["Stream this"], params)
    assert all(o.request_id == rid for o in got)
    assert "".join(o.text for o in got) == ref["text"]
    assert sum((o.token_ids for o in got), []) == ref["token_ids"]
    assert [o.finished for o in got] == [False] * (len(got) - 1) + [True]
    assert got[-1].finish_reason == ref["finish_reason"]


def test_many_random_requests_all_finish(engine):
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 20),
                             ignore_eos=True)
              for _ in prompts]
    outs = engine.generate(prompts, params)
    assert [o["num_tokens_output"] for o in outs] == [p.max_tokens for p in params]


@pytest.mark.parametrize(
    "prompt, params, param",
    [
        ("", GREEDY, "prompt"),
        ([1, 2, 10_000], GREEDY, "prompt"),
        ([1] * 256, GREEDY, "prompt"),
        (["not", "ints"], GREEDY, "prompt"),
        ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2, 3], SamplingParams(top_p=0), "top_p"),
        ([1, 2, 3], SamplingParams(temperature=-1), "temperature"),
    ],
)
def test_bad_requests_are_refused_and_nothing_is_queued(engine, prompt, params, param):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(["fine", prompt], params)
    assert err.value.param == param
    assert engine.is_finished()



@pytest.mark.parametrize("server_config, prompt_tokens_in_step", [(False, 480), (True, 448)])
def test_offline_engines_take_prompts_beside_decodes_uncapped(server_config,
                                                              prompt_tokens_in_step):
    """Built from keywords (offline), a long prompt arriving while another request decodes
    is computed whole in the next step; built from the server's config it is chunked to
    --mixed-prefill-tokens (448) so the decode is not held up."""
    from atom_core.config import Config

    opts = dict(model=str(tiny_model_dir("llama")), enable_log_stats=False, device="cpu",
                max_model_len=512)
    if server_config:
        engine = LLMEngine(config=Config.from_kwargs(**opts))
    else:
        engine = LLMEngine(**opts)
    assert engine.config.scheduler_config.mixed_prefill_tokens == (448 if server_config else 0)
    engine.add_request([[1, 2, 3]], GREEDY)
    engine.step()  # the first request's prompt: it decodes from here on
    engine.add_request([[random.Random(0).randrange(3, 200) for _ in range(480)]], GREEDY)
    engine.step()
    decoding, long = engine.scheduler.running
    assert decoding.num_computed_tokens == 4  # its prompt and one decode
    assert long.num_computed_tokens == prompt_tokens_in_step
