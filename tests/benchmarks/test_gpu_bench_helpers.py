"""The GPU benches' helpers on CPU: the roofline's bytes (dense weights + the experts a step
touched + KV) checked by hand on tiny Qwen3-MoE and DeepSeek-V2 engines, the touched-expert
counter, the batch-N decode profile, the offline run's step clock, and transformers' models
of the shipped configs (built on the meta device)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from atom_core.testing.tiny_models import tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import common  # noqa: E402
import decode_latency  # noqa: E402
import throughput_offline  # noqa: E402

pytestmark = pytest.mark.slow

ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}
ELEM = 4  # the tiny engines run in fp32


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """kind -> (engine, config dict) of a tiny MoE model with dummy weights on CPU, built
    once: 8 routed experts, top-2, hidden 64, expert intermediate 32 (DeepSeek-V2 adds 2
    shared experts)."""
    from atom_core.engine.llm_engine import LLMEngine

    built: dict[str, tuple] = {}

    def get(kind: str) -> tuple:
        if kind not in built:
            cfg = tiny_config(kind)
            cfg.architectures = [ARCH[kind]]
            path = tmp_path_factory.mktemp(kind) / "config.json"
            cfg.to_json_file(path, use_diff=False)
            engine = LLMEngine(str(path), load_dummy="empty", device="cpu", dtype="float32",
                               enable_log_stats=False, max_model_len=96, max_num_seqs=4)
            common.randomize(engine.runner.model)
            built[kind] = engine, json.loads(path.read_text())
        return built[kind]

    return get


@pytest.fixture(params=sorted(ARCH))
def tiny(request, build):
    return build(request.param)


def test_kv_bytes_per_token_of_the_shipped_configs():
    kv = {name: common.kv_bytes_per_token(common.load_config(name)) for name in common.MODELS}
    assert kv["qwen3-8b"] == 36 * 2 * 8 * 128 * 2  # GQA: K and V of 8 KV heads
    assert kv["qwen3-30b-a3b"] == 48 * 2 * 4 * 128 * 2
    assert kv["deepseek-v2-lite"] == 27 * (512 + 64) * 2  # MLA: the latent plus the RoPE key


def test_kv_bytes_per_token_matches_the_engines_cache(tiny):
    engine, cfg = tiny
    runner = engine.runner
    cache = sum(layer.kv_cache.numel() for layer in runner.attention_layers) * ELEM
    assert common.kv_bytes_per_token(cfg, ELEM) == cache // (runner.num_blocks * runner.block_size)


def test_one_sequence_touches_exactly_top_k_routed_experts(tiny):
    engine, cfg = tiny
    prompts = common.random_prompts(1, 8, cfg["vocab_size"])
    touched = common.touched_experts(engine, prompts, steps=2)
    assert list(touched.values()) == [2.0, 2.0]  # two MoE layers of three; shared slots not counted
    assert engine.is_finished()  # the counting requests were aborted


def test_step_bytes_is_dense_weights_plus_touched_experts(tiny):
    """By hand: every parameter, less the input embedding (3 rows read) and the routed
    experts not touched (3 * H * I weights each). Shared experts, folded into the stacked
    weights or a separate MLP, are read every step either way."""
    engine, cfg = tiny
    model = engine.runner.model
    prompts = common.random_prompts(3, 8, cfg["vocab_size"], 1)
    touched = common.touched_experts(engine, prompts, steps=3)
    assert len(touched) == 2 and all(2 <= t <= 6 for t in touched.values())
    h, inter, experts = 64, 32, 8
    all_params = sum(p.numel() for p in model.parameters()) * ELEM
    embed = cfg["vocab_size"] * h * ELEM
    untouched = sum((experts - t) * 3 * h * inter * ELEM for t in touched.values())
    want = all_params - embed + 3 * h * ELEM - untouched
    assert common.step_bytes(model, 3, touched) == pytest.approx(want)
    assert decode_latency.experts_per_layer(touched, cfg) == pytest.approx(
        sum(touched.values()) / 2 + cfg.get("n_shared_experts", 0))


def test_step_bytes_of_a_dense_model_reads_every_weight_once():
    def toy(tied: bool) -> nn.Module:
        model = nn.Module()
        model.model = nn.Module()
        model.model.embed_tokens = nn.Embedding(100, 8)
        model.model.proj = nn.Linear(8, 8, bias=False)
        model.lm_head = nn.Linear(8, 100, bias=False)
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model

    assert common.step_bytes(toy(tied=False), 2, {}) == (2 * 8 + 64 + 800) * 4
    assert common.step_bytes(toy(tied=True), 2, {}) == (64 + 800) * 4


def test_profile_steps_at_any_batch_size(build):
    engine, _ = build("qwen3_moe")
    prof = decode_latency.profile_steps(engine, batch=3, prompt_len=6, steps=1, graphs=True)
    assert prof["batch"] == 3 and prof["mode"] == "eager"  # no CUDA graphs on CPU
    assert prof["kernels"] and all(k["calls_per_step"] > 0 for k in prof["kernels"])
    # The runner's step labels are no kernels.
    assert not any(k["kernel"].startswith("decode[") for k in prof["kernels"])
    assert engine.is_finished()


def test_step_clock_splits_prefill_from_decode_steps(build):
    from atom_core.sampling_params import SamplingParams

    engine, cfg = build("qwen3_moe")
    prompts = common.random_prompts(2, 8, cfg["vocab_size"], 2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    wall, clock = throughput_offline.run(engine, prompts, params)
    assert clock.steps == {"prefill": 1, "decode": 3}  # both prompts in one step, then 3 decodes
    assert clock.tokens == [16, 8] and wall >= sum(clock.seconds.values())
    assert "schedule" not in vars(engine.scheduler)  # the clock let go of the scheduler
    prof = throughput_offline.profile_run(engine, prompts, params, start=1, steps=1)
    assert (prof["prefill_steps"], prof["decode_steps"]) == (0, 1) and prof["kernels"]
    assert engine.is_finished()


def test_kernel_table_sums_kernels_per_step_and_skips_annotations():
    cuda = torch.autograd.DeviceType.CUDA
    events = [
        SimpleNamespace(key="gemm", self_device_time_total=300.0, device_type=cuda, count=6,
                        is_user_annotation=False),
        SimpleNamespace(key="norm", self_device_time_total=60.0, device_type=cuda, count=12,
                        is_user_annotation=False),
        SimpleNamespace(key="decode[bs=1]", self_device_time_total=400.0, device_type=cuda, count=3,
                        is_user_annotation=True),
    ]
    total, rows = common.kernel_table(events, 3, torch.device("cuda"))
    assert total == 120.0
    assert rows == [{"kernel": "gemm", "us_per_step": 100.0, "calls_per_step": 2.0},
                    {"kernel": "norm", "us_per_step": 20.0, "calls_per_step": 4.0}]


def test_transformers_builds_every_bench_model():
    expected = {"qwen3-0.6b": ("Qwen3ForCausalLM", 0.596), "qwen3-8b": ("Qwen3ForCausalLM", 8.19),
                "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", 30.5),
                "deepseek-v2-lite": ("DeepseekV2ForCausalLM", 15.7)}
    assert set(expected) == set(common.MODELS)
    for name, (cls, billions) in expected.items():
        model = common.hf_model(name, device="meta")
        assert type(model).__name__ == cls
        assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=0.01)


def test_the_scripts_parse_their_flags():
    args = decode_latency.parse_args(["--models", *common.MODELS, "--profile"])
    assert args.batch_sizes == [1, 16, 32] and args.hf_output_len == 64
    assert args.profile_batch_sizes is None
    args = throughput_offline.parse_args(["--model", "qwen3-30b-a3b", "--profile", "16"])
    assert args.profile == 16 and args.profile_start is None


def test_gemv_config_overrides_replace_table_entries():
    from atom_kernels_triton import gemv_config

    # A copy of the shipped H200 table: main() overrides the shared one the kernels read.
    table = {k: dict(v) for k, v in gemv_config.tuned("NVIDIA H200").items()}
    args = decode_latency.parse_args(
        ["--gemv-config", "1024,2048,1=4,512,1", "--gemv-config", "4096,4096,16=cublas",
         "--gemv-config", "7,9,4=16,64,2,8,4", "--gemv-config", "6144,4096,32=128,128,2,4,4"])
    applied = decode_latency.apply_overrides(table, decode_latency.parse_gemv_override,
                                             args.gemv_config)
    assert gemv_config.get_config(1, 1024, 2048, 2, table=table) == {
        "BLOCK_N": 4, "BLOCK_K": 512, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}
    # The op calls cuBLAS.
    assert gemv_config.get_config(16, 4096, 4096, 2, table=table) is None
    assert gemv_config.get_config(3, 7, 9, 2, table=table) == {  # a shape the table lacked
        "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 8, "num_stages": 4}
    # A 32-row tile where cuBLAS ran.
    assert gemv_config.wide_config(24, 6144, 4096, 2, table=table) == {
        "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 4, "num_stages": 4}
    assert applied["4096,4096,16"] is None
    assert set(applied) == {"1024,2048,1", "4096,4096,16", "7,9,4", "6144,4096,32"}
    for bad in ("1024,2048=4,512,1", "1024,2048,3=4,512,1", "1024,2048,64=4,512,1",
                "1024,2048,1=4,512", "x"):
        with pytest.raises(SystemExit):
            decode_latency.parse_args(["--gemv-config", bad])


def test_randomize_schemes():
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(8, 16))
    common.randomize(model)  # normal: matrices drawn, vectors 1
    assert model[0].weight.std() > 0.005 and torch.equal(model[0].bias, torch.ones(16))
    common.randomize(model, scheme="vllm")
    for p in model.parameters():  # every floating parameter, vectors included
        assert p.abs().max() <= 1e-3 and p.std() > 1e-4
    # vLLM's loader reseeds for each parameter: equal sizes get equal values.
    assert torch.equal(model[0].weight, model[2].weight)
    assert torch.equal(model[0].bias, model[1].weight)
    with pytest.raises(ValueError, match="weight scheme"):
        common.randomize(model, scheme="xavier")
    assert decode_latency.parse_args(["--weights", "vllm"]).weights == "vllm"
    with pytest.raises(SystemExit):
        decode_latency.parse_args(["--weights", "xavier"])


def test_randomize_draws_mxfp4_stacks():
    """uint8 parameters are MXFP4 bytes and scales (gpt-oss): codes drawn, scales set."""
    model = nn.Module()
    model.w13_weight = nn.Parameter(torch.zeros(2, 64, 16, dtype=torch.uint8),
                                    requires_grad=False)
    model.w13_weight_scale = nn.Parameter(torch.zeros(2, 64, 1, dtype=torch.uint8),
                                          requires_grad=False)
    for scheme in common.WEIGHT_SCHEMES:
        model.w13_weight.zero_()
        common.randomize(model, scheme=scheme)
        assert len(model.w13_weight.unique()) == 256
        assert torch.all(model.w13_weight_scale == common.MXFP4_SCALE)
    from atom_core.quant.mxfp4 import dequantize

    rms = dequantize(model.w13_weight, model.w13_weight_scale, torch.float32).pow(2).mean().sqrt()
    assert 0.015 < rms < 0.03


class _PackedExperts(nn.Module):
    """Stacks shaped as gpt-oss's MXFP4 experts (4 experts, H = I = 64), called as they are."""

    def __init__(self):
        super().__init__()
        for name, shape in (("w13_weight", (4, 128, 32)), ("w13_weight_scale", (4, 128, 2)),
                            ("w2_weight", (4, 64, 32)), ("w2_weight_scale", (4, 64, 2))):
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=torch.uint8),
                                                       requires_grad=False))

    def forward(self, x, topk_weights, topk_ids):
        return x


def test_the_roofline_counts_experts_outside_the_core_by_their_stacks():
    """A plugin's experts (no FusedMoE) are found by their stacks, counted by the ids they
    are called with, and read with their scales: (128 + 64) * (32 + 2) bytes an expert."""
    model = nn.Sequential(nn.Linear(8, 8), _PackedExperts())
    assert list(common.moe_layers(model)) == ["1"]
    assert common.expert_bytes(model[1]) == (128 + 64) * (32 + 2)
    with common.ExpertCounter(model) as counter:
        model[1](torch.zeros(3, 8), torch.ones(3, 2), torch.tensor([[0, 1], [1, 2], [0, 2]]))
    assert counter.means() == {"1": 3.0}
    dense = (64 + 8) * 4
    assert common.step_bytes(model, 3, {"1": 3.0}) == dense + 3 * (128 + 64) * 34


def test_tied_routers_send_every_token_to_the_same_experts(build):
    """ATOM's engines: after tie_routers three sequences touch top-k (2) experts a layer,
    where drawn routers spread them (test_step_bytes_... sees 2-6)."""
    for kind in ARCH:
        engine, cfg = build(kind)
        before = {n: p.clone() for n, p in engine.runner.model.named_parameters()}
        try:
            assert common.tie_routers(engine.runner.model) == 2
            prompts = common.random_prompts(3, 8, cfg["vocab_size"], 1)
            touched = common.touched_experts(engine, prompts, steps=3)
            assert list(touched.values()) == [2.0, 2.0]
        finally:
            with torch.no_grad():
                for n, p in engine.runner.model.named_parameters():
                    p.copy_(before[n])


def test_tie_routers_finds_transformers_routers_and_refuses_a_dense_model():
    assert common.tie_routers(common.hf_model("deepseek-v2-lite", device="meta")) == 26
    assert common.tie_routers(common.hf_model("qwen3-30b-a3b", device="meta")) == 48
    with pytest.raises(ValueError, match="no MoE router"):
        common.tie_routers(common.hf_model("qwen3-0.6b", device="meta"))
    assert decode_latency.parse_args(["--routing", "tied"]).routing == "tied"
    with pytest.raises(SystemExit):
        decode_latency.parse_args(["--routing", "uniform"])


def test_moe_config_overrides_replace_table_entries():
    from atom_kernels_triton import fused_moe_config

    table = {k: dict(v) for k, v in fused_moe_config.tuned("NVIDIA H200").items()}
    args = decode_latency.parse_args(["--moe-config", "2048,768,32=16,64,256,4,2",
                                      "--moe-config", "64,32,8=16,32,64,2,3"])
    applied = decode_latency.apply_overrides(table, decode_latency.parse_moe_override,
                                             args.moe_config)
    assert fused_moe_config.get_config(20, 8, 128, 2048, 768, table=table) == {
        "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2}
    # A shape the table lacked.
    assert fused_moe_config.get_config(5, 2, 8, 64, 32, table=table)["BLOCK_K"] == 64
    assert set(applied) == {"2048,768,32", "64,32,8"}
    # The launch forms: PERSISTENT's programs an SM, then OVERLAP as a flag.
    assert decode_latency.parse_moe_override("2048,768,32=16,32,128,2,3,0,1")[1] == {
        "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 2, "num_stages": 3,
        "PERSISTENT": 0, "OVERLAP": True}
    for bad in ("2048,768=16,64,256,4,2", "2048,768,24=16,64,256,4,2", "2048,768,32=16,64,256", "x",
                "2048,768,32=16,32,128,2,3,0,1,1"):
        with pytest.raises(SystemExit):
            decode_latency.parse_args(["--moe-config", bad])


def test_decode_latency_prefills_each_batch_in_one_step():
    default = decode_latency.SchedulerConfig().max_num_batched_tokens
    assert decode_latency.token_budget(32, 512) == max(default, 32 * 512)
    assert decode_latency.token_budget(128, 512) == 128 * 512
    assert decode_latency.token_budget(1, 512) == default
    assert decode_latency.token_budget(512, 4096) == decode_latency.MAX_TOKEN_BUDGET


def test_params_per_token_counts_the_matrices_a_token_multiplies(build):
    # Qwen3-8B by hand: 36 layers of q/k/v, o_proj, gate/up and down; norms are vectors, and
    # the embedding and the LM head are left out.
    model = common.hf_model("qwen3-8b", device="meta")
    per_layer = 4096 * 6144 + 4096 * 4096 + 4096 * 24576 + 12288 * 4096
    assert common.params_per_token(model) == 36 * per_layer
    # Each routed expert a token picks adds its 3 * H * I weights in each of the two MoE layers.
    for kind in ARCH:
        engine, cfg = build(kind)
        model, k = engine.runner.model, cfg["num_experts_per_tok"]
        extra = common.params_per_token(model, k) - common.params_per_token(model, 0)
        assert extra == 2 * k * 3 * 64 * 32


def test_offline_floor_by_hand():
    f = common.offline_floor(2, 4, 3, params=10, head_params=5, kv_per_token=7, gemm_flops=1e3,
                             copy_bw=1e2)
    # 2 x (4 + 3 - 1) tokens forwarded x 2 x 10 FLOP, the LM head 2 x 3 sampled x 2 x 5: 300 FLOP.
    assert f["gemm_s"] == pytest.approx(0.3)
    # The two decode tokens of each prompt see 5 and 6 tokens of 7 bytes: 154 bytes.
    assert f["kv_s"] == pytest.approx(1.54)
    assert f["floor_s"] == pytest.approx(1.84) and f["floor_tok_s"] == pytest.approx(14 / 1.84)
    # The offline benchmark's run: 20.9 TB of decode KV for Qwen3-8B (147,456 bytes a token).
    kv = common.kv_bytes_per_token(common.load_config("qwen3-8b"))
    f = common.offline_floor(1024, 1024, 128, 1, 0, kv, 1.0, 1.0)
    assert f["kv_tb"] == pytest.approx(1024 * 127 * 1088 * 147456 / 1e12)


def test_offline_report_prints_the_floor_beside_the_run(capsys):
    floor = common.offline_floor(1024, 1024, 128, 6_945_767_424, 4096 * 151936, 147456, 666e12,
                                 4.27e12)
    results = {
        "atom": {"num_prompts": 1024, "wall_s": 33.0, "total_tok_s": 35_747, "output_tok_s": 3_972,
                 "steps": {"prefill": {"steps": 66, "wall_s": 25.0, "ms_per_step": 378.8},
                           "decode": {"steps": 223, "wall_s": 8.0, "ms_per_step": 35.9}}},
        "floor": {"gemm": {"watts": 690.0, "sm_mhz": 1450.0}, **floor},
    }
    throughput_offline.report(results)
    out = capsys.readouterr().out
    assert f"| floor: GEMMs + KV reads only | 1024 | {floor['floor_s']:.1f} |" in out
    assert f"ATOM at {floor['floor_s'] / 33.0:.0%} of it" in out
    assert 29.0 < floor["floor_s"] < 30.0  # 24.6 s of GEMM at 666 TFLOP/s + 4.9 s of KV


def test_num_layers_cuts_the_config_and_its_per_layer_lists(monkeypatch):
    monkeypatch.setattr(decode_latency, "ARGS", raising=False, value=decode_latency.parse_args(
        ["--models", "gpt-oss-20b", "--num-layers", "3", "--skip-hf"]))
    cfg, path = decode_latency.model_config("gpt-oss-20b")
    full = common.load_config("gpt-oss-20b")
    assert cfg["num_hidden_layers"] == 3 and cfg["layer_types"] == full["layer_types"][:3]
    assert json.loads(path.read_text()) == cfg
    assert cfg["hidden_size"] == full["hidden_size"]
    with pytest.raises(SystemExit):
        decode_latency.parse_args(["--num-layers", "3"])  # transformers would build all
