import argparse

import pytest

from atom_core.config import Config
from atom_core.engine.arg_utils import EngineArgs
from atom_core.errors import ConfigError


def parse(*argv: str) -> Config:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(list(argv))).create_config()


def test_defaults_follow_the_serving_guide():
    c = parse()
    assert c.cache_config.block_size is None  # the backends' preference, else 16
    assert c.cache_config.gpu_memory_utilization == 0.9
    assert c.cache_config.kv_cache_dtype == "bf16"
    assert c.cache_config.enable_prefix_caching is False
    assert c.scheduler_config.max_num_batched_tokens == 16384
    assert c.scheduler_config.max_num_seqs == 512
    assert c.scheduler_config.max_model_len is None
    assert c.scheduler_config.scheduler_delay_factor == 0.0
    assert c.compilation_config.enforce_eager is False
    assert c.compilation_config.level == 0  # the guide's 3 is torch.compile, not built yet
    assert c.compilation_config.cudagraph_capture_sizes[:4] == [1, 2, 4, 8]
    assert c.compilation_config.cudagraph_capture_sizes[-1] == 512  # max_num_seqs
    assert c.observability_config.enable_log_stats is True
    assert c.observability_config.throughput_log_interval == 10.0
    assert c.observability_config.port == 8006
    assert c.model_config.load_dummy is None
    assert c.model_config.seed == 0


@pytest.mark.parametrize("flag", ["--kv_cache_dtype", "--kv-cache-dtype"])
def test_both_spellings_accepted(flag):
    assert parse(flag, "bf16").cache_config.kv_cache_dtype == "bf16"


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3"])
def test_vllms_name_for_the_e4m3_cache_is_the_fp8_cache(value):
    assert parse("--kv-cache-dtype", value).cache_config.kv_cache_dtype == "fp8"
    assert Config.from_kwargs(kv_cache_dtype=value).cache_config.kv_cache_dtype == "fp8"


def test_an_e5m2_cache_is_refused_by_name():
    with pytest.raises(ConfigError, match="--kv_cache_dtype 'fp8_e5m2' is not one of"):
        Config.from_kwargs(kv_cache_dtype="fp8_e5m2")


def test_flags_reach_their_config_part():
    c = parse(
        "--model", "/m", "--max-model-len", "128", "--max-num-batched-tokens", "64",
        "--max-num-seqs", "4", "--block-size", "32", "--enable_prefix_caching", "--enforce-eager",
        "--seed", "7", "--dtype", "float32", "--scheduler-delay-factor", "0.5",
        "--no-enable-log-stats", "--throughput-log-interval", "2",
        "--gpu-memory-utilization", "0.5",
    )
    assert c.model_config.model == "/m"
    assert c.scheduler_config.max_model_len == 128
    assert c.scheduler_config.max_num_batched_tokens == 64
    assert c.scheduler_config.max_num_seqs == 4
    assert c.cache_config.block_size == 32
    assert c.cache_config.enable_prefix_caching is True
    assert c.compilation_config.enforce_eager is True
    assert c.model_config.seed == 7
    assert c.model_config.dtype == "float32"
    assert c.scheduler_config.scheduler_delay_factor == 0.5
    assert c.observability_config.enable_log_stats is False
    assert c.observability_config.throughput_log_interval == 2.0
    assert c.cache_config.gpu_memory_utilization == 0.5


@pytest.mark.parametrize(
    "argv, mode",
    [(["--load_dummy"], "empty"), (["--load_dummy=empty"], "empty"),
     (["--load_dummy", "zero"], "zero"), (["--load-dummy=xavier"], "xavier"), ([], None)],
)
def test_load_dummy_forms(argv, mode):
    assert parse(*argv).model_config.load_dummy == mode


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-tp", "0"], "--tensor-parallel-size must be >= 1"),
        (["-tp", "2", "--method", "ngram"], "with --tensor-parallel-size > 1 is not supported"),
        (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
        (["-tp", "4", "--nnodes", "3", "--master-port", "1"], "does not split evenly over"),
        (["-dp", "2", "-tp", "2", "--master-port", "29500"], "leave --master-port out"),
        (["--method", "nope"], "unknown --method .nope.; registered: draft_model, eagle3, mtp, "
                               "ngram"),
        (["--trust-remote-code"], "--trust-remote-code is not supported"),
        (["--block-size", "12"], "power of two"),
        (["--gpu-memory-utilization", "1.5"], "gpu-memory-utilization"),
        (["--enable-dp-attention"], "needs -dp N > 1"),
        (["--enable-dp-attention", "-dp", "2", "-tp", "2"], "-tp > 1 is not supported yet"),
        (["--enable-dp-attention", "-dp", "2", "--method", "ngram"], "speculative decoding"),
        (["--enable-dp-attention", "-dp", "2", "--device", "cuda"], "use --device cpu"),
        (["--level", "3"], "torch.compile"),
        (["--prefill-cudagraph-sizes", "1", "64"], "2 or more"),
        (["--mixed-prefill-tokens", "-1"], "must be >= 0"),
    ],
)
def test_unimplemented_or_invalid_flags_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


def test_flat_kwargs_and_unknown_ones():
    c = Config.from_kwargs(model="x", max_model_len=99, enable_prefix_caching=True)
    assert c.scheduler_config.max_model_len == 99 and c.cache_config.enable_prefix_caching
    with pytest.raises(ConfigError, match="unknown engine option 'max_len'"):
        Config.from_kwargs(max_len=3)


def test_several_nodes_need_a_port_to_meet_on(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ConfigError, match="needs --master-port"):
        parse("-tp", "2", "--nnodes", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert parse("-tp", "2", "--nnodes", "2").parallel_config.nnodes == 2
