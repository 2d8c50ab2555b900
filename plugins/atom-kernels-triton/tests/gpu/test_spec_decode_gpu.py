"""Speculative decoding on the GPU (Triton attention, CUDA graphs): verify steps run as
decode rows from the decode graphs, one row per draft, so rows of one sequence read K/V
that the same step wrote (the decode kernel's preloading grids reload those rows after
their wait). Greedy output with n-gram drafts and with a draft model equals the engine
without them, in fp32 so verify rows and plain decodes round alike; a model drafting for
itself has every draft accepted. Batch 1 runs the many-split (preloading) grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.sampling_params import SamplingParams  # noqa: E402
from atom_core.testing.tiny_models import tiny_model_dir  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 4, [20, 21, 22, 23, 24, 25] * 5, [7] * 12,
           [11, 12, 13, 14, 15] * 6, [3, 1, 4, 1, 5, 9, 2, 6] * 3]
LENGTHS = (40, 23, 31, 17, 29)
KW = dict(device="cuda", dtype="float32", enable_log_stats=False, max_model_len=512,
          enable_prefix_caching=True)


def outputs(kind: str, batch: int, **kw) -> tuple[LLMEngine, list[list[int]]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in LENGTHS[:batch]]
    engine = LLMEngine(str(tiny_model_dir(kind)), **KW, **kw)
    return engine, [o["token_ids"] for o in engine.generate(PROMPTS[:batch], params)]


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_v3"])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("k", [1, 3])
def test_ngram_greedy_equals_plain_on_gpu(kind, batch, k):
    _, plain = outputs(kind, batch)
    spec, outs = outputs(kind, batch, method="ngram", num_speculative_tokens=k)
    assert outs == plain
    assert spec.speculator.stats.total_accepted_tokens > 0
    assert spec.runner.graphs is not None


@pytest.mark.parametrize("batch", [1, 5])
def test_target_as_its_own_draft_on_gpu(batch):
    _, plain = outputs("qwen3", batch)
    spec, outs = outputs("qwen3", batch, method="draft_model", num_speculative_tokens=3,
                         draft_model=str(tiny_model_dir("qwen3")))
    assert outs == plain
    stats = spec.speculator.stats
    assert stats.total_draft_tokens > 20
    assert stats.total_accepted_tokens == stats.total_draft_tokens


def dummy_dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Config-only directories for dummy weights: a tiny DeepSeek-V3 with one MTP layer, a
    tiny Llama, and an EAGLE-3 draft for it in the published layout."""
    ds = json.loads((tiny_model_dir("deepseek_v3") / "config.json").read_text())
    llama = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    # Two target layers: the default aux layers (2, N // 2, N - 3) lie outside them.
    eagle = {**llama, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
             "draft_vocab_size": 128,
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}}
    dirs = []
    for name, config in (("mtp", {**ds, "num_nextn_predict_layers": 1}), ("llama", llama),
                         ("eagle3", eagle)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        dirs.append(tmp_path / name)
    return dirs[0], dirs[1], dirs[2]


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
@pytest.mark.parametrize("batch", [1, 5])
def test_hidden_state_drafts_on_gpu(method, batch, tmp_path):
    """MTP and EAGLE-3 with dummy weights (target and draft): the draft network's graphs
    read the target graphs' hidden output; output equals the plain engine's."""
    mtp, llama, eagle = dummy_dirs(tmp_path)
    target = mtp if method == "mtp" else llama
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in LENGTHS[:batch]]
    kw = dict(KW, load_dummy="xavier")
    plain = [o["token_ids"] for o in LLMEngine(str(target), **kw).generate(PROMPTS[:batch],
                                                                            params)]
    extra = {"draft_model": str(eagle)} if method == "eagle3" else {}
    spec = LLMEngine(str(target), method=method, num_speculative_tokens=3, **kw, **extra)
    assert spec.runner.graphs is not None and spec.speculator.drafter.graphs is not None
    outs = [o["token_ids"] for o in spec.generate(PROMPTS[:batch], params)]
    assert outs == plain
    assert spec.speculator.stats.total_draft_tokens > 20
