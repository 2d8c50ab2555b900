"""--async-scheduling: steps run one ahead (step k+1 scheduled and queued before step k's
tokens are read), decode-only and mixed (prefill chunks beside decodes) alike. On CPU the GPU
decode path is switched on by hand, so the same launch/collect code runs; every output must
equal the synchronous engine's, token for token, whatever stops the requests (length, stop
tokens, stop strings, aborts, new arrivals)."""

from __future__ import annotations

import random

import pytest

from atom_core.engine.llm_engine import LLMEngine
from atom_core.engine.step_graphs import MAX_PROMPTS
from atom_core.sampling_params import SamplingParams
from atom_core.testing.engine_reference import hf_greedy, hf_model
from atom_core.testing.tiny_models import tiny_model_dir


def engine(async_scheduling: bool, **kw) -> LLMEngine:
    eng = LLMEngine(
        str(tiny_model_dir("qwen3")), enable_log_stats=False, device="cpu", block_size=4,
        async_scheduling=async_scheduling, **kw,
    )
    eng.runner.fast_decode = True
    eng.runner._setup_fast_decode()
    return eng


def count_run_ahead(eng: LLMEngine) -> list[int]:
    """Records 1 for each step queued from the previous step's device ids, else 0."""
    calls: list[int] = []
    launch = eng.runner.launch

    def spy(batch, ids_from=None):
        calls.append(int(ids_from is not None))
        return launch(batch, ids_from=ids_from)

    eng.runner.launch = spy
    return calls


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def all_blocks_free(eng: LLMEngine) -> bool:
    return eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_greedy_equals_sync_and_transformers_with_staggered_lengths():
    ps = prompts(4)
    lengths = [3, 17, 9, 24]  # requests leave the batch at different steps: drain, restart
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    sync = engine(False).generate(ps, params)
    eng = engine(True)
    ahead = count_run_ahead(eng)
    outs = eng.generate(ps, params)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in sync]
    assert [o["finish_reason"] for o in outs] == ["length"] * 4
    assert [len(o["token_ids"]) for o in outs] == lengths
    hf = hf_greedy(hf_model(tiny_model_dir("qwen3")), ps, max(lengths))
    assert [o["token_ids"] for o in outs] == [h[:n] for h, n in zip(hf, lengths)]
    # Every step after the first is queued behind the one before: a request reaching
    # max_tokens sits the next step out instead of draining the pipeline for all.
    assert ahead == [0] + [1] * (max(lengths) - 1)
    assert all_blocks_free(eng)


def test_stop_token_seen_one_step_late_drops_the_extra_token():
    ps = prompts(3, seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base = engine(False).generate(ps, greedy)
    # Stop each request on its own 8th output token: unknown until that step is read.
    stops = [o["token_ids"][7] for o in base]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[t])
              for t in stops]
    sync = engine(False).generate(ps, params)
    eng = engine(True)
    ahead = count_run_ahead(eng)
    outs = eng.generate(ps, params)
    for o, s in zip(outs, sync):
        assert o["token_ids"] == s["token_ids"]
        assert o["finish_reason"] == s["finish_reason"] == "stop"
        assert o["stop_reason"] == s["stop_reason"]
    assert sum(ahead) > 0
    assert all_blocks_free(eng)


def test_stop_strings_and_text_equal_sync():
    ps = ["Hello there", "The quick brown fox", "Numbers: 1 2 3"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = engine(False).generate(ps, greedy)
    stop = [o["text"][6:9] for o in base]  # a string the greedy text reaches mid-way
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_strings=[s])
        for s in stop
    ]
    sync = engine(False).generate(ps, params)
    outs = engine(True).generate(ps, params)
    assert [o["text"] for o in outs] == [o["text"] for o in sync]
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in sync]
    assert [o["stop_reason"] for o in outs] == stop


def test_seeded_sampling_equals_sync():
    ps = prompts(3, seed=2)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=16, ignore_eos=True)
              for i in range(3)]
    sync = engine(False).generate(ps, params)
    outs = engine(True).generate(ps, params)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in sync]


def test_host_side_sampling_never_runs_ahead():
    # Penalties read the token history and logprobs are read per step: no run-ahead.
    ps = prompts(2, seed=3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
    ]
    sync = engine(False).generate(ps, params)
    eng = engine(True)
    ahead = count_run_ahead(eng)
    outs = eng.generate(ps, params)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in sync]
    assert sum(ahead) == 0 and len(ahead) > 0


def test_abort_and_arrival_mid_pipeline():
    ps = prompts(4, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eng = engine(True)
    ahead = count_run_ahead(eng)
    got: dict[str, list[int]] = {}

    def collect(out):
        got.setdefault(out.request_id, []).extend(out.token_ids)

    rids = eng.add_request(ps[:3], params, stream_callback=collect)
    for _ in range(8):
        eng.step()
    assert sum(ahead) > 0  # the pipeline is running when the batch changes
    assert eng.abort_request(rids[1])
    late = eng.add_request([ps[3]], params, stream_callback=collect)
    while not eng.is_finished():
        eng.step()
    hf = hf_greedy(hf_model(tiny_model_dir("qwen3")), ps, 20)
    assert got[rids[0]] == hf[0] and got[rids[2]] == hf[2] and got[late[0]] == hf[3]
    assert got[rids[1]] == hf[1][: len(got[rids[1]])]  # a prefix, then nothing more
    assert all_blocks_free(eng)


@pytest.mark.parametrize("max_model_len", [40])
def test_max_model_len_and_preemption_pressure_equal_sync(max_model_len):
    # A small KV pool: sequences are preempted, some with a placeholder queued (recomputed
    # later from the resolved token), and certain stops at max_model_len drain the pipeline.
    ps = prompts(4, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kw = dict(num_gpu_blocks_override=24, max_model_len=max_model_len)
    sync = engine(False, **kw).generate(ps, params)
    eng = engine(True, **kw)
    outs = eng.generate(ps, params)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in sync]
    assert [o["finish_reason"] for o in outs] == [o["finish_reason"] for o in sync]
    assert all_blocks_free(eng)


def test_runs_ahead_while_requests_wait_for_a_seat():
    # max_num_seqs running and more waiting (a loaded server): no waiting request can join,
    # so the decode batch still runs ahead; a request that finishes frees its seat one step
    # late, and the next waiting one is admitted then. Outputs equal the synchronous engine's.
    ps = prompts(5, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (6, 14, 9, 20, 11)]
    sync = engine(False, max_num_seqs=2).generate(ps, params)
    eng = engine(True, max_num_seqs=2)
    waiting_when_ahead: list[int] = []
    launch = eng.runner.launch

    def spy(batch, ids_from=None):
        if ids_from is not None:
            waiting_when_ahead.append(eng.scheduler.num_waiting)
        return launch(batch, ids_from=ids_from)

    eng.runner.launch = spy
    outs = eng.generate(ps, params)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in sync]
    assert [len(o["token_ids"]) for o in outs] == [6, 14, 9, 20, 11]
    assert sum(1 for w in waiting_when_ahead if w > 0) >= 5  # ran ahead with requests queued
    assert eng.scheduler.num_running == 0 and all_blocks_free(eng)


def test_mixed_steps_run_ahead_and_equal_sync():
    # A small token budget chunks each prompt over several steps beside the running
    # decodes, and requests arrive while others decode: prefill chunks, first tokens and
    # decodes are all queued from the previous step's device ids. Outputs equal the
    # synchronous engine's and transformers'.
    ps = prompts(6, seed=6)
    lengths = [5, 12, 3, 9, 15, 7]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    kw = dict(max_num_batched_tokens=16, max_num_seqs=4)
    sync = engine(False, **kw).generate(ps, params)
    eng = engine(True, **kw)
    mixed_ahead: list[bool] = []
    launch = eng.runner.launch

    def spy(batch, ids_from=None):
        if not eng.runner.is_plain_decode(batch):
            mixed_ahead.append(ids_from is not None)
        return launch(batch, ids_from=ids_from)

    eng.runner.launch = spy
    got: dict[str, list[int]] = {}

    def collect(out):
        got.setdefault(out.request_id, []).extend(out.token_ids)

    rids = eng.add_request(ps[:3], params[:3], stream_callback=collect)
    for _ in range(4):
        eng.step()
    rids += eng.add_request(ps[3:], params[3:], stream_callback=collect)
    while not eng.is_finished():
        eng.step()
    assert [got[r] for r in rids] == [o["token_ids"] for o in sync]
    hf = hf_greedy(hf_model(tiny_model_dir("qwen3")), ps, max(lengths))
    assert [got[r] for r in rids] == [h[:n] for h, n in zip(hf, lengths)]
    assert sum(mixed_ahead) >= 5  # mixed steps really ran ahead
    assert all_blocks_free(eng)


def test_seeded_sampling_with_chunked_prefill_equals_sync():
    ps = prompts(4, seed=7)
    params = [SamplingParams(temperature=0.9, top_k=20, seed=11 + i, max_tokens=10, ignore_eos=True)
              for i in range(4)]
    kw = dict(max_num_batched_tokens=12, max_num_seqs=3)
    sync = engine(False, **kw).generate(ps, params)
    outs = engine(True, **kw).generate(ps, params)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in sync]


def test_prompt_logprobs_step_runs_on_its_own():
    # A step owing prompt logprobs reads the device on the host: it is not queued ahead,
    # and the steps around it still are.
    ps = prompts(3, seed=8)
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ]
    sync = engine(False, max_num_batched_tokens=16).generate(ps, params)
    eng = engine(True, max_num_batched_tokens=16)
    ahead: list[bool] = []
    owing_ahead: list[bool] = []  # steps computing prompt logprobs: queued behind another?
    launch = eng.runner.launch

    def spy(batch, ids_from=None):
        ahead.append(ids_from is not None)
        if any(s.sampling_params.prompt_logprobs is not None
               and len(s.prompt_logprobs) < s.num_prompt_tokens
               for s in batch.seqs):
            owing_ahead.append(ids_from is not None)
        return launch(batch, ids_from=ids_from)

    eng.runner.launch = spy
    outs = eng.generate(ps, params)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in sync]
    assert [lp.token_id for lp in outs[1]["prompt_logprobs"][1:]] == ps[1][1:]
    assert [lp.logprob for lp in outs[1]["prompt_logprobs"][1:]] == [
        lp.logprob for lp in sync[1]["prompt_logprobs"][1:]
    ]
    assert owing_ahead and not any(owing_ahead)
    assert sum(ahead) > 0


def test_first_token_time_is_set_when_a_queued_prefill_is_read():
    # The prefill runs ahead too, so a request's first token arrives as a resolved
    # placeholder: TTFT and TPOT must still come from when the host read each token.
    eng = engine(True)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = eng.generate(prompts(2, seed=9), params)
    for o in outs:
        assert 0 < o["ttft"] < o["latency"]
        assert o["tpot"] > 0 and o["ttft"] + 11 * o["tpot"] == pytest.approx(o["latency"])


@pytest.mark.parametrize("async_scheduling,prefix_caching", [(True, True), (False, False)])
def test_warmup_runs_eager_prefills_beside_every_power_of_two_of_decodes(
    async_scheduling, prefix_caching
):
    # The Triton attention kernels of a mixed step are specialised on its number of decodes
    # (the KV split count): warm-up compiles them all before serving starts. A step graph
    # sizes its decode attention for its capacity, so the rounds must run eagerly: each
    # round's prompts outnumber what a graph holds.
    eng = engine(async_scheduling, max_num_seqs=32, enable_prefix_caching=prefix_caching)
    eng.runner._setup_step_graphs(use_graphs=False)  # the step-graph path, run eagerly
    eager: set[int] = set()
    launch_eager = eng.runner._launch_eager

    def spy(batch, ids_from=None):
        lens = batch.num_scheduled_tokens
        if max(lens) > 1:
            eager.add(sum(1 for n in lens if n == 1))
        return launch_eager(batch, ids_from)

    eng.runner._launch_eager = spy
    eng.warmup(mixed_rounds=True)
    # and beside the most decodes that leave room for the joining prompts
    assert {1, 2, 4, 8, 16, 32 - (MAX_PROMPTS + 1)} <= eager
    assert eng.is_finished() and not eng._requests and all_blocks_free(eng)
    assert eng.block_manager.prefix_cache_queries == 0
    ps = prompts(2, seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert [o["token_ids"] for o in eng.generate(ps, params)] == [
        o["token_ids"] for o in engine(False).generate(ps, params)
    ]


def test_warmup_on_a_cpu_is_one_short_generate():
    # Nothing compiles on a CPU: the rounds would only delay a server's start.
    eng = engine(True, max_num_seqs=20)
    batches = []
    launch = eng.runner.launch
    eng.runner.launch = lambda batch, ids_from=None: (
        batches.append(batch.num_scheduled_tokens) or launch(batch, ids_from=ids_from))
    eng.warmup()
    assert batches and all(len(lens) == 1 for lens in batches)  # one sequence throughout
    assert eng.is_finished() and not eng._requests and all_blocks_free(eng)


def test_prefix_cache_hits_on_blocks_a_queued_step_writes():
    # A prompt admitted while the step prefilling its twin is still queued hits the twin's
    # blocks (committed when that step was queued); its reads are queued behind the writes.
    base = prompts(1, seed=11)[0] * 3  # 40-90 tokens: several full blocks of 4
    ps = [base + [1], base + [2], base + [3, 4]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(enable_prefix_caching=True, max_num_batched_tokens=32)
    sync = engine(False, **kw)
    ref = [o["token_ids"] for o in sync.generate(ps, params)]
    eng = engine(True, **kw)
    got: dict[str, list[int]] = {}

    def collect(out):
        got.setdefault(out.request_id, []).extend(out.token_ids)

    rids = eng.add_request(ps[:1], params, stream_callback=collect)
    for _ in range(3):
        eng.step()
    rids += eng.add_request(ps[1:], params, stream_callback=collect)
    while not eng.is_finished():
        eng.step()
    assert [got[r] for r in rids] == ref
    assert eng.block_manager.prefix_cache_hits > 0
    hf = hf_greedy(hf_model(tiny_model_dir("qwen3")), ps, 8)
    assert [got[r] for r in rids] == hf
