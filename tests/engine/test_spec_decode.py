"""Speculative decoding in the engine (engine/spec_decode.py) with the core's methods,
n-gram lookup and a draft model (engine/drafter.py): greedy output equals the engine
without speculation, token for token, through chunked prefill, prefix caching and
preemption; drafts are really accepted (all of them, where the draft is the target
itself); max_tokens and stop strings that fall inside an accepted run cut it there;
streaming equals the final text; forced acceptance realizes its schedule; bad flags fail
at start."""

from __future__ import annotations

import json
import shutil

import pytest

from atom_core.config import ConfigError
from atom_core.engine.llm_engine import LLMEngine
from atom_core.loader import embedded_model_path
from atom_core.sampling_params import SamplingParams
from atom_core.testing.tiny_models import tiny_model_dir

# Repeating prompts: the n-gram proposer (5-token tails) finds its matches in them, and a
# tiny random model's greedy continuation of a loop tends to loop.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11] * 4,
    [20, 21, 22, 23, 24, 25] * 5 + [20, 21],
    [3, 1, 4, 1, 5, 9, 2, 6] * 3,
    [7] * 12,
    [40, 41, 42, 43, 44, 45, 46, 47, 48] * 2,
    [11, 12, 13, 14, 15] * 6,
    [90, 91, 92, 93, 94, 95] * 4,
    [5, 6, 7, 8, 9, 10, 11] * 4 + [1, 2],  # shares a prefix with the first
]


TARGET = "qwen3"
CHUNKED = dict(enable_prefix_caching=True, max_num_batched_tokens=24, num_gpu_blocks_override=40,
               max_model_len=128, max_num_seqs=8)
LENGTHS = (30, 17, 25, 40, 9, 33, 21, 28)


def engine(method: str | None, **kw) -> LLMEngine:
    opts = dict(enable_log_stats=False, device="cpu", block_size=4)
    opts.update(kw)
    if method is not None:
        opts["method"] = method
    return LLMEngine(str(tiny_model_dir("qwen3")), **opts)


@pytest.fixture(scope="module")
def plain_chunked() -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in LENGTHS]
    return [o["token_ids"] for o in engine(None, **CHUNKED).generate(PROMPTS, params)]


def run_chunked(method: str, k: int, buffers: bool = False,
                **kw) -> tuple[LLMEngine, list[list[int]]]:
    """``buffers``: decode and verify steps through the GPU path's static decode buffers
    (``DecodeInputs``), run eagerly on the CPU."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in LENGTHS]
    spec = engine(method, num_speculative_tokens=k, **CHUNKED, **kw)
    if buffers:
        spec.runner.fast_decode = True
        spec.runner._setup_fast_decode()
    outs = [o["token_ids"] for o in spec.generate(PROMPTS, params)]
    assert spec.num_preemptions > 0  # 40 blocks of 4 tokens do not hold all eight
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks
    return spec, outs


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_ngram_equals_plain_engine_with_chunks_caching_and_preemption(k, plain_chunked):
    spec, outs = run_chunked("ngram", k)
    assert outs == plain_chunked
    stats = spec.speculator.stats
    assert stats.total_accepted_tokens > 0 and stats.total_draft_tokens > 0
    assert stats.average_tokens_per_forward > 1.0


@pytest.mark.parametrize("k", [1, 3])
def test_target_as_its_own_draft_accepts_every_draft(k, plain_chunked):
    spec, outs = run_chunked("draft_model", k, draft_model=str(tiny_model_dir(TARGET)))
    assert outs == plain_chunked
    stats = spec.speculator.stats
    assert stats.total_draft_tokens > 50
    assert stats.total_accepted_tokens == stats.total_draft_tokens


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_verify_rows_through_the_decode_buffers(method, plain_chunked):
    """Each draft a decode row of its own in the static buffers, as the GPU's graphs run
    them: the rows of one sequence see each other's K/V."""
    spec, outs = run_chunked(method, 3, buffers=True, **(
        {"draft_model": str(tiny_model_dir(TARGET))} if method == "draft_model" else {}))
    assert outs == plain_chunked
    assert spec.speculator.stats.total_accepted_tokens > 20


def test_random_draft_model_changes_nothing_but_acceptance(plain_chunked):
    spec, outs = run_chunked("draft_model", 3, draft_model=str(tiny_model_dir(TARGET, seed=1)))
    assert outs == plain_chunked
    stats = spec.speculator.stats
    assert stats.total_draft_tokens > 50
    assert stats.acceptance_rate < 0.5


def test_draft_model_streams_and_samples_reproducibly():
    draft = str(tiny_model_dir(TARGET))
    spec = engine("draft_model", num_speculative_tokens=3, draft_model=draft)
    pieces: dict[str, list[str]] = {}

    def collect(out):
        pieces.setdefault(out.request_id, []).append(out.text)

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    rids = spec.add_request(PROMPTS[:4], params, stream_callback=collect)
    while not spec.is_finished():
        spec.step()
    plain = engine(None).generate(PROMPTS[:4], params)
    assert ["".join(pieces[r]) for r in rids] == [o["text"] for o in plain]
    seeded = [SamplingParams(temperature=0.8, seed=s, max_tokens=20, ignore_eos=True)
              for s in range(4)]
    a = engine("draft_model", num_speculative_tokens=3, draft_model=draft).generate(
        PROMPTS[:4], seeded)
    b = engine("draft_model", num_speculative_tokens=3, draft_model=draft).generate(
        PROMPTS[:4], seeded)
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]


def test_max_tokens_and_stop_strings_cut_an_accepted_run():
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (1, 2, 3, 5, 7, 11, 13, 19)]
    plain = engine(None).generate(PROMPTS, params)
    spec = engine("ngram", num_speculative_tokens=4)
    outs = spec.generate(PROMPTS, params)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in plain]
    assert [len(o["token_ids"]) for o in outs] == [1, 2, 3, 5, 7, 11, 13, 19]
    # A stop string taken from the plain run's text, a few tokens in.
    full = engine(None).generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=30,
                                                              ignore_eos=True))[0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_strings=[stop])
    a = engine(None).generate(PROMPTS[:1], sp)[0]
    b = engine("ngram", num_speculative_tokens=4).generate(PROMPTS[:1], sp)[0]
    assert (b["text"], b["finish_reason"]) == (a["text"], a["finish_reason"])
    assert a["finish_reason"] == "stop"


def test_streamed_pieces_equal_the_final_text():
    spec = engine("ngram", num_speculative_tokens=3)
    pieces: dict[str, list[str]] = {}
    ids: dict[str, list[int]] = {}

    def collect(out):
        pieces.setdefault(out.request_id, []).append(out.text)
        ids.setdefault(out.request_id, []).extend(out.token_ids)

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    rids = spec.add_request(PROMPTS, params, stream_callback=collect)
    while not spec.is_finished():
        spec.step()
    plain = engine(None).generate(PROMPTS, params)
    assert ["".join(pieces[r]) for r in rids] == [o["text"] for o in plain]
    assert [ids[r] for r in rids] == [o["token_ids"] for o in plain]
    assert spec.speculator.stats.total_accepted_tokens > 0


@pytest.mark.parametrize("length", [1.0, 2.5, 4.0])
def test_forced_acceptance_realizes_the_requested_length(length):
    spec = engine("ngram", num_speculative_tokens=3, spec_decode_acceptance_length=length)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    spec.generate(PROMPTS[:4], params)
    stats = spec.speculator.stats
    assert stats.num_verifications > 150
    # Runs cut short by max_tokens accept fewer: allow for the last verification of each.
    assert stats.average_tokens_per_forward == pytest.approx(length, abs=0.05)


def test_seeded_sampling_reproduces():
    params = [SamplingParams(temperature=0.8, top_k=20, seed=s, max_tokens=20, ignore_eos=True)
              for s in range(4)]
    a = engine("ngram", num_speculative_tokens=3).generate(PROMPTS[:4], params)
    b = engine("ngram", num_speculative_tokens=3).generate(PROMPTS[:4], params)
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]


@pytest.mark.parametrize(("kw", "message"), [
    ({"method": "nope"}, "unknown --method 'nope'; registered: .*draft_model.*ngram"),
    ({"method": "draft_model"}, "--method draft_model needs --draft-model"),
    ({"draft_model": "x"}, "--draft-model needs --method"),
    ({"method": "ngram", "draft_model": "x"}, "--method ngram reads no --draft-model"),
    ({"method": "draft_model", "draft_model": "/nonexistent"}, "does not exist"),
    ({"method": "draft_model", "draft_model": str(embedded_model_path())},
     "vocabulary of 49152 tokens, the target 272"),
    ({"method": "draft_model", "draft_model": "short-draft"}, "handles 64 positions, fewer "
     "than --max-model-len 512"),
    ({"spec_decode_acceptance_length": 2.0}, "need --method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "--num-speculative-tokens must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 3, "spec_decode_acceptance_length": 5.0},
     "acceptance"),
    ({"method": "ngram", "spec_decode_acceptance_length": 1.5,
      "spec_decode_acceptance_rate": 0.5}, "mutually exclusive"),
])
def test_bad_speculative_flags_fail_at_start(kw, message, tmp_path):
    if kw.get("draft_model") == "short-draft":  # the target's config with fewer positions
        short = tmp_path / "short"
        shutil.copytree(tiny_model_dir(TARGET), short)
        config = json.loads((short / "config.json").read_text())
        (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
        kw = {**kw, "draft_model": str(short)}
    with pytest.raises(ConfigError, match=message):
        LLMEngine(str(tiny_model_dir("qwen3")), device="cpu", **kw)
