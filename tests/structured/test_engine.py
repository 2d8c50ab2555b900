"""Constrained generation through the whole engine on a tiny random model (byte-level
vocabulary): seeded samples at temperature 1 all match their JSON schema, regex or choice;
preemption, --async-scheduling and the GPU step paths (switched on by hand on CPU) keep
the matcher in step with the tokens; unconstrained batches never touch a grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from atom_core.engine.llm_engine import LLMEngine
from atom_core.errors import InvalidRequestError
from atom_core.sampling_params import SamplingParams
from atom_core.structured import StructuredSpec
from atom_core.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow

# Every string, array and number bounded: a random model samples uniformly among what the
# grammar allows, and must still finish inside max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"enum": ["cat", "dog", "hamster"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"vip": {"type": "boolean"},
                           "note": {"anyOf": [{"type": "null"},
                                              {"type": "string", "maxLength": 3}]}},
            "required": ["vip", "note"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"
CHOICES = ["red", "green", "blue", "a|b", 'say "hi"']
N = 50


def engine(**kw) -> LLMEngine:
    return LLMEngine(str(tiny_model_dir("llama")), device="cpu", enable_log_stats=False,
                     max_model_len=512, **kw)


def sampled(spec: StructuredSpec, n: int = N, **kw) -> list[SamplingParams]:
    kw.setdefault("max_tokens", 400)
    return [SamplingParams(temperature=1.0, seed=i, structured=spec, **kw) for i in range(n)]


def prompts(n: int = N) -> list[list[int]]:
    return [[1 + i % 200, 2, 3] for i in range(n)]


@pytest.fixture(scope="module")
def eng() -> LLMEngine:
    return engine()


def test_json_schema_samples_all_validate(eng):
    outs = eng.generate(prompts(), sampled(StructuredSpec.json_schema(SCHEMA)))
    for o in outs:
        assert o["finish_reason"] == "stop"
        jsonschema.validate(json.loads(o["text"]), SCHEMA)
        assert o["text"] == json.dumps(json.loads(o["text"]), ensure_ascii=False) or "\\" in o[
            "text"]  # compact, as json.dumps writes it (escapes aside)
    assert len({o["text"] for o in outs}) > N // 2  # the seeds gave different samples


def test_regex_samples_all_match(eng):
    outs = eng.generate(prompts(), sampled(StructuredSpec("regex", REGEX, "guided_regex")))
    assert all(o["finish_reason"] == "stop" and re.fullmatch(REGEX, o["text"]) for o in outs)
    assert len({o["text"] for o in outs}) > N // 2


def test_choice_samples_are_all_choices(eng):
    outs = eng.generate(prompts(), sampled(StructuredSpec.choice(CHOICES)))
    assert all(o["finish_reason"] == "stop" and o["text"] in CHOICES for o in outs)
    assert len({o["text"] for o in outs}) >= 4


def test_grammar_and_a_mixed_batch(eng):
    # A Lark grammar beside unconstrained rows: each row keeps its own constraint.
    grammar = StructuredSpec("grammar", 'start: "x" NUM ("," NUM)*\nNUM: /[0-9]{1,2}/',
                             "guided_grammar")
    params = sampled(grammar, 6) + [SamplingParams(temperature=1.0, seed=9, max_tokens=20,
                                                   ignore_eos=True)] * 2
    outs = eng.generate(prompts(8), params)
    assert all(re.fullmatch(r"x[0-9]{1,2}(,[0-9]{1,2})*", o["text"]) for o in outs[:6])
    assert [len(o["token_ids"]) for o in outs[6:]] == [20, 20]


def test_a_complete_match_ends_the_sequence_under_ignore_eos(eng):
    [out] = eng.generate([[5, 6]], sampled(StructuredSpec.choice(["yes", "no"]), 1,
                                           ignore_eos=True))
    assert out["finish_reason"] == "stop" and out["text"] in ("yes", "no")
    assert out["token_ids"][-1] in eng.eos_token_ids  # the EOS the mask left alone


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_sequences_keep_their_matchers(eng, prefix_caching):
    # A pool too small for all of them: sequences are preempted and recomputed mid-output
    # (with the prefix cache, partly from their own cached blocks).
    spec = StructuredSpec("regex", REGEX, "guided_regex")
    small = LLMEngine(str(tiny_model_dir("llama")), device="cpu", enable_log_stats=False,
                      max_model_len=64, num_gpu_blocks_override=16, block_size=4,
                      enable_prefix_caching=prefix_caching)
    outs = small.generate(prompts(12), sampled(spec, 12, max_tokens=60))
    assert small.num_preemptions > 0
    if prefix_caching:
        assert small.block_manager.prefix_cache_hits > 0
    # Seeded draws depend on the seed and step count only: the same texts as unpressed.
    alone = eng.generate(prompts(12), sampled(spec, 12, max_tokens=60))
    assert [o["text"] for o in outs] == [o["text"] for o in alone]
    assert all(re.fullmatch(REGEX, o["text"]) for o in outs)


def gpu_paths(async_scheduling: bool) -> LLMEngine:
    """The GPU decode path and padded mixed steps, eagerly on CPU."""
    eng = engine(async_scheduling=async_scheduling, block_size=4, max_num_batched_tokens=64)
    eng.runner.fast_decode = True
    eng.runner._setup_fast_decode()
    eng.runner._setup_step_graphs(use_graphs=False)
    return eng


def test_async_scheduling_runs_constrained_steps_in_order():
    spec = StructuredSpec("regex", REGEX, "guided_regex")
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [plain, *sampled(spec, 4), plain]
    ps = [[7] * 40, *prompts(4), [9] * 30]  # long prompts: chunked beside the decodes
    sync = gpu_paths(False).generate(ps, params)
    eng = gpu_paths(True)
    ahead: list[bool] = []
    launch = eng.runner.launch

    def spy(batch, ids_from=None):
        if ids_from is not None:
            assert all(s.grammar is None for s in batch.seqs)  # never ahead of a matcher
        ahead.append(ids_from is not None)
        return launch(batch, ids_from=ids_from)

    eng.runner.launch = spy
    outs = eng.generate(ps, params)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in sync]
    assert all(re.fullmatch(REGEX, o["text"]) for o in outs[1:5])
    assert any(ahead)  # the plain requests ran ahead once the constrained ones were done


def test_unconstrained_steps_never_fill_a_bitmask(monkeypatch):
    import atom_core.engine.model_runner as model_runner

    def refuse(*args, **kw):
        raise AssertionError("a bitmask was filled for a batch without constraints")

    monkeypatch.setattr(model_runner, "fill_bitmask", refuse)
    eng = gpu_paths(True)
    outs = eng.generate(prompts(4), [SamplingParams(temperature=1.0, seed=i, max_tokens=8)
                                     for i in range(4)])
    assert all(o["token_ids"] for o in outs)


def test_speculative_decoding_refuses_constraints():
    eng = engine(method="ngram", num_speculative_tokens=2)
    with pytest.raises(InvalidRequestError, match="speculative decoding") as info:
        eng.add_request([[1, 2]], SamplingParams(structured=StructuredSpec.choice(["a"])))
    assert info.value.param == "guided_choice"
    assert eng.is_finished()
