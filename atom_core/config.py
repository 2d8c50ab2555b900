"""Config and its parts: the one source of truth for every engine setting.

Each field's ``metadata`` carries its CLI spelling and help; ``engine/arg_utils.py``
derives the flags from these dataclasses, so a setting is never written down twice.
Flag spellings and defaults follow the serving guide's "Engine CLI arguments" table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from atom_core.errors import ConfigError

# Every 8 rows up to 256, every 16 up to 512 (sizes past --max-num-seqs are dropped): a
# decode step past the largest runs eagerly, and at ~500 sequences its launches bound it.
DEFAULT_CAPTURE_SIZES = [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]
# Every 64 tokens up to 1024, every 128 up to 2048, and three small ones: padding adds at
# most 12.5% of rows from 512 tokens on.
DEFAULT_PREFILL_CAPTURE_SIZES = [16, 32, 48, *range(64, 1025, 64), *range(1152, 2049, 128)]
LOAD_DUMMY_MODES = ("empty", "zero", "xavier")
DEFAULT_BLOCK_SIZE = 16  # KV cache tokens per block where no attention backend prefers one


def opt(default: Any, flags: tuple[str, ...], help: str, **extra: Any) -> Any:
    """A config field with its CLI flags and help text."""
    meta = {"flags": flags, "help": help, **extra}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class CacheConfig:
    block_size: int | None = opt(
        None, ("--block-size",),
        "KV cache block size (tokens per block); default: the largest page size the "
        f"model's attention backends prefer on the device, else {DEFAULT_BLOCK_SIZE}",
    )
    gpu_memory_utilization: float = opt(
        0.9, ("--gpu-memory-utilization",), "fraction of GPU memory the engine may use (0, 1]"
    )
    kv_cache_dtype: str = opt(
        "bf16", ("--kv_cache_dtype", "--kv-cache-dtype"),
        "KV cache dtype: bf16 (the cache is kept in the model's --dtype) or fp8 (e4m3, "
        "values saturated, one scale per layer for K and one for V: the checkpoint's "
        "k_scale/v_scale, else --kv-cache-scales, else 1.0); fp8_e4m3 is the same (vLLM's "
        "name for it)",
        choices=("bf16", "fp8", "fp8_e4m3", "auto"),
    )
    kv_cache_scales: list[float] | None = opt(
        None, ("--kv-cache-scales",),
        "with --kv_cache_dtype fp8: the scale of K and of V (one value for both, or K then "
        "V) in layers whose checkpoint has none; the cache stores x / scale",
        nargs="+",
    )
    calculate_kv_scales: bool = opt(
        False, ("--calculate-kv-scales",),
        "with --kv_cache_dtype fp8: measure each layer's K and V scales at start-up from a "
        "calibration text, in layers whose checkpoint has none",
    )
    enable_prefix_caching: bool = opt(
        False, ("--enable_prefix_caching", "--enable-prefix-caching"),
        "reuse KV blocks of shared prompt prefixes",
    )
    num_gpu_blocks_override: int | None = opt(
        None, ("--num-gpu-blocks-override",),
        "use exactly this many KV blocks (testing, capacity planning)",
    )
    cpu_kv_cache_space_gib: float = opt(
        4.0, ("--cpu-kv-cache-space",), "GiB of KV cache when running on CPU"
    )

    def __post_init__(self) -> None:
        # One name past this point: the runner, the loader and the scales compare to "fp8".
        if self.kv_cache_dtype == "fp8_e4m3":
            self.kv_cache_dtype = "fp8"


# An LLMEngine built from keyword options (offline batches, where no stream waits on its
# next token) takes prompts beside decodes uncapped, as vLLM's offline LLM class defaults
# differ from its server's: on the H200, fp8 Qwen3-8B offline (bench/throughput_offline.py)
# ran 39,167 tok/s uncapped and 34,461 at the server's 448 (bench/RESULTS.md).
OFFLINE_MIXED_PREFILL_TOKENS = 0


@dataclass
class SchedulerConfig:
    max_num_seqs: int = opt(512, ("--max-num-seqs",), "maximum sequences per batch")
    max_num_batched_tokens: int = opt(
        16384, ("--max-num-batched-tokens",), "maximum tokens per step; longer prefills are chunked"
    )
    max_model_len: int | None = opt(
        None, ("--max-model-len",), "maximum context length (default: the model's)"
    )
    # 448, the server's: the sweep in bench/RESULTS.md (bench/serving_gpu.py, Qwen3-8B at
    # concurrency 64 on an H200): with step graphs, prompts taken a few hundred tokens a
    # step beside the decodes gave the best request rate and a median TTFT a fifth of
    # 4096's; 448 beside 64 decodes fills the 512-token graph.
    mixed_prefill_tokens: int = opt(
        448, ("--mixed-prefill-tokens",),
        "while sequences decode, a step computes at most this many prompt tokens beside them "
        "(longer prompts are chunked), so decodes are not held up by a long prefill and "
        "prompts stream their first tokens sooner; with nothing decoding a step takes up to "
        "--max-num-batched-tokens. 0: no cap of its own (an LLMEngine built from keyword "
        "options, offline, defaults to 0)",
    )
    # The first wave of a burst is the tail of TTFT: with decodes running, 63 prompts that
    # arrive together enter 448 tokens a step, the last after ~70 steps. Past this wait the
    # overdue prompts are taken whole, in steps of up to --max-num-batched-tokens. 250: of
    # 0, 150 and 250 (bench/serving_gpu.py at concurrency 64, bench/RESULTS.md), the one that
    # cut the P99 TTFT without moving the median; 150 cut it further but raised the mean.
    prefill_deadline_ms: float = opt(
        250.0, ("--prefill-deadline-ms",),
        "a prompt that has waited this long (ms, since it arrived) for its prefill is no longer "
        "held to --mixed-prefill-tokens: the steps take every overdue prompt's tokens, up to "
        "--max-num-batched-tokens, so a burst of arrivals is not trickled in beside the "
        "decodes for longer than this. 0: never",
    )
    scheduler_delay_factor: float = opt(
        0.0, ("--scheduler-delay-factor",),
        "wait this fraction of the last step's latency before admitting a new prompt, "
        "to batch arrivals",
    )
    # On by default: measured on an H200, it takes 0.1-0.4 ms off every decode step and
    # ~5% off an offline run's wall (bench/RESULTS.md); --no-async-scheduling gives the
    # one-step-at-a-time engine.
    async_scheduling: bool = opt(
        True, ("--async-scheduling",),
        "GPU: schedule and queue step k+1 before reading step k's tokens, so the host's work "
        "overlaps the GPU's (a stop token or string is seen one step late; that step's token "
        "is dropped)",
        boolean_optional=True,
    )


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = opt(
        1, ("--tensor-parallel-size", "-tp"),
        "tensor parallel size: the model's layers split across this many processes (CPU, "
        "gloo, so far); see docs/parallelism.md",
    )
    data_parallel_size: int = opt(
        1, ("--data-parallel-size", "-dp"),
        "atom serve: this many engine replicas, each with the whole model, behind one "
        "frontend; a request goes to the replica with the fewest tokens outstanding",
    )
    data_parallel_rank: int | None = opt(
        None, ("--data-parallel-rank",),
        "this engine's index among the -dp replicas (atom serve sets it for each; it names "
        "the replica's profiler traces dp{d}_tp{t}/rank_{r})",
    )
    enable_expert_parallel: bool = opt(
        False, ("--enable-expert-parallel",),
        "MoE: split whole experts across the tensor-parallel ranks instead of every "
        "expert's intermediate size",
    )
    enable_dp_attention: bool = opt(
        False, ("--enable-dp-attention",),
        "MoE models with -dp N: each replica keeps its own requests and attention, and the "
        "MoE experts are split whole across the replicas, which exchange their tokens in "
        "every MoE layer and step together (CPU, gloo, so far)",
    )
    nnodes: int = opt(
        1, ("--nnodes",), "machines the tensor-parallel ranks span (tp / nnodes ranks each)"
    )
    node_rank: int = opt(
        0, ("--node-rank",),
        "this machine's index: 0 runs the server and rank 0; any other starts only its ranks",
    )
    master_addr: str | None = opt(
        None, ("--master-addr",),
        "node 0's address, where the ranks meet (default: $MASTER_ADDR, else 127.0.0.1)",
    )
    master_port: int | None = opt(
        None, ("--master-port",),
        "the port the ranks meet on (default: $MASTER_PORT; with one node, a free port)",
    )


@dataclass
class CompilationConfig:
    enforce_eager: bool = opt(
        False, ("--enforce-eager",), "disable CUDA graph capture; run eagerly"
    )
    # The guide's default is 3 (torch.compile); not built, so 0 (eager + CUDA graphs). A
    # probe of it on CPU (bench/cpu_decode.py --compiled) found no gain for ~10 s of compile.
    level: int = opt(0, ("--level",),
                     "compilation level 0-3; only 0 (eager, CUDA-graph decode) so far",
                     choices=(0, 1, 2, 3))
    cudagraph_capture_sizes: list[int] = opt(
        DEFAULT_CAPTURE_SIZES, ("--cudagraph-capture-sizes",),
        "batch sizes captured as CUDA graphs", nargs="+",
    )
    prefill_cudagraph_sizes: list[int] = opt(
        DEFAULT_PREFILL_CAPTURE_SIZES, ("--prefill-cudagraph-sizes",),
        "token counts captured as CUDA graphs for steps that compute prompt tokens (a lone "
        "prompt, chunks, prompts beside running decodes; padded up to the next size); none: "
        "run such steps eagerly",
        nargs="*",
    )


# Speculative methods whose draft weights are a checkpoint of their own (--draft-model).
DRAFT_MODEL_METHODS = ("draft_model", "eagle3")


@dataclass
class SpeculativeConfig:
    method: str | None = opt(
        None, ("--method",),
        "speculative decoding method: a registered proposer (`atom plugins` lists them; the "
        "core's is ngram, prompt lookup)",
    )
    num_speculative_tokens: int = opt(
        1, ("--num-speculative-tokens",), "draft tokens proposed and verified per step"
    )
    draft_model: str | None = opt(
        None, ("--draft-model",),
        "the draft's checkpoint for --method draft_model (any causal LM sharing the target's "
        "vocabulary) and eagle3 (an EAGLE-3 draft directory)",
    )
    spec_decode_acceptance_length: float | None = opt(
        None, ("--spec-decode-acceptance-length",),
        "benchmark only: force this mean acceptance length in [1, k+1] (the target's own "
        "token included), ignoring draft/target agreement; the text is meaningless",
    )
    spec_decode_acceptance_rate: float | None = opt(
        None, ("--spec-decode-acceptance-rate",),
        "benchmark only: the same as a rate in [0, 1], (length - 1) / k",
    )


@dataclass
class ModelConfig:
    model: str | None = opt(
        None, ("--model",), "Hugging Face repo id (owner/name), HF directory, .gguf file, or "
        "config.json with --load_dummy (default: the embedded SmolLM2-135M-Instruct)"
    )
    revision: str | None = opt(
        None, ("--revision",), "with a repo id --model: the branch, tag or commit to load"
    )
    download_dir: str | None = opt(
        None, ("--download-dir",),
        "with a repo id --model: the Hugging Face cache to use (default: huggingface_hub's, "
        "$HF_HUB_CACHE or $HF_HOME/hub)",
    )
    tokenizer: str | None = opt(
        None, ("--tokenizer",), "tokenizer directory (default: the model's)"
    )
    chat_template: str | None = opt(
        None, ("--chat-template",),
        "the chat template to use instead of the model's, for rendering chats and for reading "
        "its tool-call format and reasoning dialect: a file, or the Jinja text itself",
    )
    generation_config: str = opt(
        "auto", ("--generation-config",),
        "defaults for the sampling fields a request leaves out (temperature, top_p, top_k, "
        "min_p, repetition_penalty, max_tokens): auto (the model's generation_config.json; "
        "for the embedded model, temperature 0.2 and top_p 0.9, its model card's), none or "
        "vllm (the API's defaults: temperature 1, no filters, 256 tokens), or a folder "
        "holding a generation_config.json",
    )
    dtype: str = opt(
        "auto", ("--dtype",), "weights and activations dtype: auto (bf16 on GPU, fp32 on CPU), "
        "bfloat16, float16, float32",
        choices=("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32"),
    )
    load_dummy: str | None = opt(
        None, ("--load_dummy", "--load-dummy"),
        "dummy weights, no checkpoint read: bare flag or =empty, =zero, =xavier",
        nargs="?", const="empty", choices=LOAD_DUMMY_MODES,
    )
    trust_remote_code: bool = opt(
        False, ("--trust-remote-code",), "trust remote code (refused: not supported)"
    )
    quantization: str | None = opt(
        None, ("--quantization", "-q"),
        "fp8: quantize the weights online at load (e4m3, one scale per output channel; the "
        "checkpoint on disk is unchanged). none: compute in --dtype. Default: none, but an "
        "FP8 checkpoint (fp8 per block or tensor, compressed-tensors float-quantized), read "
        "dequantized, is quantized again (fp8) where the GPU computes in FP8",
        choices=("fp8", "none"),
    )
    fp8_layers: list[str] = opt(
        ["attention", "mlp", "experts"], ("--fp8-layers",),
        "with --quantization fp8, the layer kinds quantized",
        nargs="+", choices=("attention", "mlp", "experts", "lm_head"),
    )
    fp8_w8a8_min_rows: int | None = opt(
        None, ("--fp8-w8a8-min-rows",),
        "with --quantization fp8, steps of at least this many tokens quantize activations per "
        "token (W8A8 on fp8 tensor cores); smaller ones keep them in --dtype and dequantize "
        "the weights in the kernel (weight-only). Default: measured per layer kind, 64 for "
        "the dense projections, 256 for the experts",
    )
    seed: int = opt(0, ("--seed",), "seed for dummy weights and unseeded sampling")
    device: str = opt("auto", ("--device",), "auto, cpu or cuda")


@dataclass
class ObservabilityConfig:
    enable_log_stats: bool = opt(
        True, ("--enable-log-stats",), "emit the periodic engine-status line", boolean_optional=True
    )
    throughput_log_interval: float = opt(
        10.0, ("--throughput-log-interval",), "seconds between status lines"
    )
    torch_profiler_dir: str | None = opt(
        None, ("--torch-profiler-dir",), "directory for torch profiler traces"
    )
    mark_trace: bool = opt(
        False, ("--mark-trace",),
        "write one trace per captured CUDA-graph size to {profiler dir}/capture_traces/ "
        "(needs a profiler dir)",
    )
    # Accepted so the serving guide's command lines run; the engine link is private IPC.
    port: int = opt(
        8006, ("--port",),
        "accepted for compatibility and unused: the engine talks to the frontend over private, "
        "authenticated IPC sockets; no TCP port is opened",
    )


PARTS: dict[str, type] = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "compilation_config": CompilationConfig,
    "speculative_config": SpeculativeConfig,
    "observability_config": ObservabilityConfig,
}


@dataclass
class Config:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> Config:
        """Build from flat field names (``LLMEngine(model, max_model_len=...)``)."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in PARTS}
        owner = {f.name: part for part, dc in PARTS.items() for f in fields(dc)}
        for key, value in kwargs.items():
            if key not in owner:
                raise ConfigError(f"unknown engine option {key!r}")
            parts[owner[key]][key] = value
        config = cls(**{part: PARTS[part](**vals) for part, vals in parts.items()})
        config.validate()
        return config

    def _validate_choices(self) -> None:
        """A value outside a field's ``choices`` is refused here too, not only by the CLI:
        ``LLMEngine(quantization="int4")`` must not run unquantized."""
        for part in PARTS:
            obj = getattr(self, part)
            for f in fields(obj):
                choices, value = f.metadata.get("choices"), getattr(obj, f.name)
                if choices is None or (value is None and f.default is None):
                    continue
                values = value if isinstance(value, list) else [value]
                bad = [v for v in values if v not in choices]
                if bad:
                    raise ConfigError(f"{f.metadata['flags'][0]} {bad[0]!r} is not one of "
                                      f"{', '.join(map(str, choices))}")

    def _validate_speculative(self) -> None:
        spec = self.speculative_config
        forced = (spec.spec_decode_acceptance_length, spec.spec_decode_acceptance_rate)
        if spec.method is None:
            if forced != (None, None):
                raise ConfigError("--spec-decode-acceptance-length/-rate need --method")
            if spec.draft_model is not None:
                raise ConfigError("--draft-model needs --method (draft_model or eagle3)")
            return
        from atom_core.plugins import get_registries  # plugins load after config parsing

        methods = get_registries().proposers
        if spec.method not in methods:
            raise ConfigError(f"unknown --method {spec.method!r}; registered: "
                              f"{', '.join(methods.names()) or 'none'}")
        if spec.num_speculative_tokens < 1:
            raise ConfigError("--num-speculative-tokens must be >= 1")
        if spec.method in DRAFT_MODEL_METHODS and spec.draft_model is None:
            raise ConfigError(f"--method {spec.method} needs --draft-model")
        if spec.method not in DRAFT_MODEL_METHODS and spec.draft_model is not None:
            raise ConfigError(f"--method {spec.method} reads no --draft-model (only "
                              f"{' and '.join(DRAFT_MODEL_METHODS)} do)")
        from atom_core.spec_decode.forced import resolve_acceptance_length

        try:
            resolve_acceptance_length(spec.num_speculative_tokens, *forced)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _validate_dp_attention(self) -> None:
        p = self.parallel_config
        if p.data_parallel_size < 2:
            raise ConfigError("--enable-dp-attention needs -dp N > 1: the replicas whose "
                              "attention is data-parallel")
        if p.tensor_parallel_size != 1:
            raise ConfigError("--enable-dp-attention with -tp > 1 is not supported yet: each "
                              "replica is one rank")
        if self.speculative_config.method is not None:
            raise ConfigError("--enable-dp-attention with speculative decoding (--method) is "
                              "not supported yet")
        if self.model_config.device not in ("cpu", "auto"):
            raise ConfigError("--enable-dp-attention runs on CPU (gloo) so far: use --device "
                              "cpu")

    def validate(self) -> None:
        """Refuse what this version does not implement, rather than ignoring it."""
        p, c = self.parallel_config, self.cache_config
        s, m = self.scheduler_config, self.model_config
        if p.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size must be >= 1")
        if p.tensor_parallel_size > 1 and self.speculative_config.method is not None:
            raise ConfigError("speculative decoding (--method) with --tensor-parallel-size > 1 "
                              "is not supported yet")
        if p.data_parallel_size < 1:
            raise ConfigError("--data-parallel-size must be >= 1")
        if c.kv_cache_scales is not None:
            if c.kv_cache_dtype != "fp8":
                raise ConfigError("--kv-cache-scales needs --kv_cache_dtype fp8")
            if not (1 <= len(c.kv_cache_scales) <= 2
                    and all(0 < x < float("inf") for x in c.kv_cache_scales)):
                raise ConfigError("--kv-cache-scales takes one or two finite positive numbers "
                                  f"(K, or K then V), got {c.kv_cache_scales}")
        if c.calculate_kv_scales:
            if c.kv_cache_dtype != "fp8":
                raise ConfigError("--calculate-kv-scales needs --kv_cache_dtype fp8")
            if c.kv_cache_scales is not None:
                raise ConfigError("--calculate-kv-scales and --kv-cache-scales both set the "
                                  "scales: give one")
        if p.data_parallel_rank is not None and p.data_parallel_rank < 0:
            raise ConfigError(f"--data-parallel-rank must be >= 0, got {p.data_parallel_rank}")
        if p.nnodes < 1 or not 0 <= p.node_rank < p.nnodes:
            raise ConfigError(f"--node-rank {p.node_rank} is not one of --nnodes {p.nnodes}")
        if p.tensor_parallel_size % p.nnodes:
            raise ConfigError(f"--tensor-parallel-size {p.tensor_parallel_size} does not "
                              f"split evenly over --nnodes {p.nnodes}")
        if p.nnodes > 1 and p.data_parallel_size > 1:
            raise ConfigError("--data-parallel-size > 1 over several nodes is not supported "
                              "yet: span nodes with --tensor-parallel-size")
        if p.data_parallel_size > 1 and p.tensor_parallel_size > 1 and p.master_port:
            raise ConfigError("--master-port with -dp > 1: each replica's ranks meet on a free "
                              "port of their own; leave --master-port out")
        if p.nnodes > 1 and p.master_port is None and not os.environ.get("MASTER_PORT"):
            raise ConfigError("--nnodes > 1 needs --master-port (or $MASTER_PORT): where the "
                              "nodes' ranks meet")
        if p.enable_dp_attention:
            self._validate_dp_attention()
        if self.compilation_config.level != 0:
            raise ConfigError(
                f"--level {self.compilation_config.level} (torch.compile) is not supported yet; "
                "use --level 0 (eager prefill, CUDA-graph decode)"
            )
        self._validate_choices()
        self._validate_speculative()
        if m.trust_remote_code:
            raise ConfigError("--trust-remote-code is not supported: "
                              "ATOM runs only registered architectures")
        if m.quantization == "fp8":
            from atom_core.quant.fp8 import check_options

            try:
                check_options(m.fp8_layers, m.fp8_w8a8_min_rows)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if c.block_size is not None and (c.block_size < 1 or c.block_size & (c.block_size - 1)):
            raise ConfigError(f"--block-size must be a power of two, got {c.block_size}")
        if not 0 < c.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {c.gpu_memory_utilization}")
        if c.num_gpu_blocks_override is not None and c.num_gpu_blocks_override < 1:
            raise ConfigError("--num-gpu-blocks-override must be >= 1")
        if s.max_num_seqs < 1 or s.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-seqs and --max-num-batched-tokens must be >= 1")
        if any(n < 2 for n in self.compilation_config.prefill_cudagraph_sizes):
            raise ConfigError("--prefill-cudagraph-sizes must be token counts of 2 or more "
                              "(a one-token step is a decode)")
        if s.mixed_prefill_tokens < 0:
            raise ConfigError("--mixed-prefill-tokens must be >= 0 (0: no cap of its own)")
        if s.max_model_len is not None and s.max_model_len < 1:
            raise ConfigError("--max-model-len must be >= 1")
        if s.prefill_deadline_ms < 0:
            raise ConfigError("--prefill-deadline-ms must be >= 0 (0: never)")
        if s.scheduler_delay_factor < 0:
            raise ConfigError("--scheduler-delay-factor must be >= 0")
        if m.chat_template is not None:
            from atom_core.loader.chat_template import load_chat_template

            load_chat_template(m.chat_template)  # a missing file or a syntax error: now
        from atom_core.generation_defaults import check_setting

        check_setting(m.generation_config)
        if m.load_dummy is not None and m.load_dummy not in LOAD_DUMMY_MODES:
            raise ConfigError(
                f"--load_dummy must be one of {LOAD_DUMMY_MODES}, got {m.load_dummy!r}")
        o = self.observability_config
        if o.mark_trace and not (o.torch_profiler_dir or os.environ.get("ATOM_TORCH_PROFILER_DIR")):
            raise ConfigError("--mark-trace needs --torch-profiler-dir or ATOM_TORCH_PROFILER_DIR")
        if m.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {m.device!r}")
