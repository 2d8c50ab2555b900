"""Qwen3 architecture numbers (public facts) for the GPU benches, and helpers they share:
a dummy-weight engine with random weights drawn on the GPU, transformers' model of the same
config, and the copy bandwidth measured in the same process."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "head_dim": 128,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        **_QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        **_QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
    },
}


def config_path(name: str) -> Path:
    """A config.json of model ``name`` (bench/configs/<name>/config.json if another bench
    ships one, else written from CONFIGS into a temporary directory)."""
    shipped = Path(__file__).parent / "configs" / name / "config.json"
    if shipped.exists():
        return shipped
    d = Path(tempfile.mkdtemp(prefix=f"atom-{name}-"))
    (d / "config.json").write_text(json.dumps(CONFIGS[name]))
    return d / "config.json"


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights drawn on the device (never time on zeros or uninitialised memory)."""
    torch.manual_seed(seed)
    for p in model.parameters():
        if p.dim() >= 2:
            p.normal_(0.0, 0.02)
        else:
            p.fill_(1.0)


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step streams: every parameter once, except an untied input
    embedding (a decode reads one row of it)."""
    seen: set[int] = set()
    total = 0
    embed = None
    for name, module in model.named_modules():
        if name.endswith("embed_tokens"):
            embed = module.weight
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is embed and head is not embed:
            continue
        total += p.numel() * p.element_size()
    return total


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (median of 20)."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) * 2 / times[len(times) // 2]


def hf_model(name: str, dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in CONFIGS[name].items() if k != "architectures"})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    randomize(model)
    return model.eval()


def machine() -> dict[str, Any]:
    import platform

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name, "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
    }
