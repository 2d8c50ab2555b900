"""``--method mtp``: DeepSeek-V3's multi-token-prediction layer as the draft network, on a
tiny random DeepSeek-V3 checkpoint that carries one MTP layer in the real checkpoint's
layout (``model.layers.{num_hidden_layers}.*``, per-expert tensors, in a shard of its own
listed by the index). Checked: greedy speculative output equals the plain engine's token
for token (prefix caching, chunked prefill, preemption), with drafts made, and accepted
where the layer is made to guess right; the module's forward and logits equal an
independent reference (see ``test_mtp_forward_and_logits_match_an_independent_reference``);
the embedding and head are the target's where the checkpoint has no copy, and dummy weights
leave the target's alone; checkpoints and targets without MTP layers are refused with a
clear ConfigError."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from atom_models_deepseek.mtp import DeepseekMTP, MTPDraft
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RotaryEmbedding,
)

from atom_core.config import Config
from atom_core.engine.llm_engine import LLMEngine
from atom_core.errors import ConfigError
from atom_core.layers.context import forward_context
from atom_core.loader import load_model
from atom_core.plugins import get_registries
from atom_core.sampling_params import SamplingParams
from atom_core.spec_decode.proposer import ProposerContext
from atom_core.testing.paged_kv import PagedKV, allocate_kv_caches
from atom_core.testing.tiny_models import tiny_config, tiny_model_dir

# Outside the decoder block: what the MTP layer adds (names under model.layers.{N}.).
OWN_PARTS = ("embed_tokens.weight", "shared_head.head.weight")


def _mtp_weights(config: Any, seed: int) -> tuple[dict[str, torch.Tensor], DeepseekV3DecoderLayer]:
    """Random MTP tensors in the checkpoint's names, and transformers' decoder block holding
    the same block tensors. Weights ~ N(0, 1/fan_in), norms in [0.5, 1.5], a routing bias
    that changes expert choices: so every part shows in the output."""
    g = torch.Generator().manual_seed(seed)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # transformers' per-expert loop
    block = DeepseekV3DecoderLayer(config, config.num_hidden_layers).eval()
    with torch.no_grad():
        for name, t in [*block.named_parameters(), *block.named_buffers()]:
            if name.endswith("norm.weight"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.05)
            else:
                t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
    hidden, vocab = config.hidden_size, config.vocab_size
    tensors = {
        "embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
        "enorm.weight": torch.rand(hidden, generator=g) + 0.5,
        "hnorm.weight": torch.rand(hidden, generator=g) + 0.5,
        "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5,
        "shared_head.norm.weight": torch.rand(hidden, generator=g) + 0.5,
        "shared_head.head.weight": torch.randn(vocab, hidden, generator=g) / hidden**0.5,
    }
    inter = config.moe_intermediate_size
    for name, t in block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":  # [E, 2I, H], gate rows then up rows
            for e in range(t.shape[0]):
                tensors[f"mlp.experts.{e}.gate_proj.weight"] = t[e, :inter].clone()
                tensors[f"mlp.experts.{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                tensors[f"mlp.experts.{e}.down_proj.weight"] = t[e].clone()
        else:
            tensors[name] = t.clone()
    return tensors, block


def _with_mtp_layer(dst: Path, tensors: dict[str, torch.Tensor], n_layers: int,
                    depth: int = 1) -> Path:
    """tiny deepseek_v3 copied to ``dst`` with ``tensors`` as layer ``n_layers`` in a shard
    of its own, both shards in the index, and num_nextn_predict_layers = ``depth``."""
    shutil.copytree(tiny_model_dir("deepseek_v3"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = depth
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    prefix = f"model.layers.{n_layers}."
    save_file({prefix + n: t.contiguous() for n, t in tensors.items()},
              str(dst / "model-mtp.safetensors"))
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    weight_map.update(dict.fromkeys((prefix + n for n in tensors), "model-mtp.safetensors"))
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    config = tiny_config("deepseek_v3")
    tensors, block = _mtp_weights(config, seed=7)
    path = _with_mtp_layer(tmp_path_factory.mktemp("mtp") / "ckpt", tensors,
                           config.num_hidden_layers)
    return path, tensors, block, config


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_rows(tensors, block, config, tokens: list[int], hidden: torch.Tensor):
    """DeepSeek-V3's MTP step over one sequence's rows (token t(p+1), hidden h(p)) at
    positions 0..T-1, causal: (block outputs [T, H], logits [T, V])."""
    eps, n = config.rms_norm_eps, len(tokens)
    e = _rms(tensors["embed_tokens.weight"][torch.tensor(tokens)], tensors["enorm.weight"], eps)
    h = _rms(hidden, tensors["hnorm.weight"], eps)
    x = (torch.cat([e, h], dim=-1) @ tensors["eh_proj.weight"].T)[None]
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    cos_sin = DeepseekV3RotaryEmbedding(config)(x, pos)
    y = block(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)[0]
    logits = _rms(y, tensors["shared_head.norm.weight"], eps) @ tensors["shared_head.head.weight"].T
    return y, logits


def _proposer_context(path: Path, **kw) -> ProposerContext:
    config = Config.from_kwargs(model=str(path), method="mtp", num_speculative_tokens=3, **kw)
    loaded = load_model(config, "cpu", torch.float32)
    return ProposerContext(config, loaded.model, loaded.hf_config, torch.device("cpu"),
                           torch.float32)


@torch.no_grad()
def test_mtp_forward_and_logits_match_an_independent_reference(reference):
    """The reference shares no code with the engine's: the embedding, both RMSNorms, the
    concatenation and ``eh_proj`` in plain torch, the decoder block as transformers'
    ``DeepseekV3DecoderLayer`` (its own MLA, yarn RoPE and sigmoid-routed MoE, over the full
    sequence with a causal mask) holding the tensors the test drew, before they were split
    per expert into the checkpoint. The module under test is loaded from that checkpoint
    through the registered ``mtp`` factory and runs over the paged latent cache in three
    steps as the drafter drives it: two prompts' rows; a draft step that feeds each last
    row's argmax and output back (the absorbed decode over the cache) beside a chunk of
    new rows; then another draft step. Every row and its logits must match (fp32, 1e-4)."""
    path, tensors, block, config = reference
    draft = get_registries().proposers.get("mtp")(_proposer_context(path))
    assert isinstance(draft, MTPDraft) and draft.reads_target_hidden
    module = draft.module
    # The checkpoint's own copies of the embedding and head, not the target's.
    assert set(OWN_PARTS) <= dict(module.named_parameters()).keys()
    kv = PagedKV(num_blocks=32, block_size=4, seed=3)
    allocate_kv_caches(draft, kv)
    g = torch.Generator().manual_seed(1)
    vocab, hidden = config.vocab_size, config.hidden_size
    ctx_ids: list[list[int]] = [[], []]  # each sequence's rows so far
    ctx_hidden = [torch.empty(0, hidden), torch.empty(0, hidden)]
    seqs = [kv.add_sequence() for _ in ctx_ids]

    def step(new_ids: list[list[int]], new_hidden: list[torch.Tensor]):
        """Run the new rows; check each against the reference over its whole sequence;
        return (last output row, last row's argmax) per sequence."""
        lens = [len(r) for r in new_ids]
        meta, positions = kv.step(seqs, lens)
        with forward_context(meta):
            out, carry = draft.forward(torch.tensor(sum(new_ids, [])), positions,
                                       torch.cat(new_hidden))
        assert carry is out
        logits = draft.compute_logits(out)
        last = []
        for i, (o, lg) in enumerate(zip(out.split(lens), logits.split(lens))):
            ctx_ids[i] += new_ids[i]
            ctx_hidden[i] = torch.cat([ctx_hidden[i], new_hidden[i]])
            want, want_logits = _reference_rows(tensors, block, config, ctx_ids[i],
                                                ctx_hidden[i])
            torch.testing.assert_close(o, want[-lens[i]:], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(lg, want_logits[-lens[i]:], atol=1e-4, rtol=1e-4)
            last.append((o[-1:], int(lg[-1].argmax())))
        return last

    def rand_rows(n: int) -> tuple[list[int], torch.Tensor]:
        return torch.randint(0, vocab, (n,), generator=g).tolist(), torch.randn(n, hidden,
                                                                                 generator=g)

    (a, ha), (b, hb), (c, hc) = rand_rows(9), rand_rows(6), rand_rows(3)
    last = step([a, b], [ha, hb])
    last = step([[last[0][1]], c], [last[0][0], hc])  # a draft step beside a chunk
    step([[t] for _, t in last], [h for h, _ in last])


PROMPT_LENS = (7, 30, 25, 12, 41, 22)
MAX_TOKENS = (20, 12, 26, 17, 9, 23)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(vocab) for _ in range(16)]  # prefix cache hits
    return [shared[:n] if n <= 16 else shared + [rng.randrange(vocab) for _ in range(n - 16)]
            for n in PROMPT_LENS]


ENGINE = dict(enable_log_stats=False, device="cpu", block_size=4, enable_prefix_caching=True,
              max_num_batched_tokens=16, num_gpu_blocks_override=36, max_model_len=96,
              max_num_seqs=6)


@pytest.fixture(scope="module")
def plain_tokens(reference):
    path, _, _, config = reference
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = LLMEngine(str(path), **ENGINE).generate(_prompts(config.vocab_size), params)
    return [o["token_ids"] for o in outs]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_mtp_equals_plain_engine_with_chunks_caching_and_preemption(
        reference, plain_tokens, k):
    path, _, _, config = reference
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    spec = LLMEngine(str(path), method="mtp", num_speculative_tokens=k, **ENGINE)
    assert isinstance(spec.speculator.drafter.network, MTPDraft)
    outs = spec.generate(_prompts(config.vocab_size), params)
    assert [o["token_ids"] for o in outs] == plain_tokens
    stats = spec.speculator.stats
    assert stats.total_draft_tokens > 0
    assert stats.num_verifications > 0
    assert spec.num_preemptions > 0
    assert spec.block_manager.prefix_cache_hit_rate > 0
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def _copying_mtp(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MTP layer made to draft its input token again: eh_proj passes the normed
    embedding through, the block adds nothing (o_proj and every down projection zero), and
    the head is the embedding of unit rows (unit norms), so token t's row scores highest."""
    out = dict(tensors)
    embed = torch.nn.functional.normalize(tensors["embed_tokens.weight"], dim=-1)
    hidden = embed.shape[1]
    out["embed_tokens.weight"], out["shared_head.head.weight"] = embed, embed.clone()
    out["enorm.weight"], out["shared_head.norm.weight"] = torch.ones(hidden), torch.ones(hidden)
    out["eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    for name, t in tensors.items():
        if name == "self_attn.o_proj.weight" or name.endswith("down_proj.weight"):
            out[name] = torch.zeros_like(t)
    return out


def test_drafts_are_accepted_where_the_mtp_layer_guesses_right(reference, plain_tokens,
                                                                tmp_path):
    """The greedy tiny target repeats tokens in runs; a layer that drafts the token it reads
    is right inside them. Output still equals the plain engine's, drafts are accepted, and
    no more than the runs allow (a draft is only ever its own input token)."""
    path, tensors, _, config = reference
    copying = _with_mtp_layer(tmp_path / "copying", _copying_mtp(tensors),
                              config.num_hidden_layers)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    spec = LLMEngine(str(copying), method="mtp", num_speculative_tokens=3, **ENGINE)
    outs = [o["token_ids"] for o in spec.generate(_prompts(config.vocab_size), params)]
    assert outs == plain_tokens
    repeats = sum(a == b for toks in outs for a, b in zip(toks, toks[1:]))
    stats = spec.speculator.stats
    assert 0 < stats.total_accepted_tokens <= repeats
    assert stats.average_tokens_per_forward > 1.1


def test_fp8_kv_cache_scale_of_the_mtp_layer_is_measured(reference):
    """``--calculate-kv-scales``: the MTP layer's latent cache gets a measured scale, as the
    target's layers do, and greedy output stays the plain fp8 engine's."""
    path, _, _, config = reference
    fp8 = dict(ENGINE, kv_cache_dtype="fp8", calculate_kv_scales=True)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    plain = LLMEngine(str(path), **fp8).generate(_prompts(config.vocab_size), params)
    spec = LLMEngine(str(path), method="mtp", num_speculative_tokens=2, **fp8)
    (scale,) = spec.runner.drafter.attention_layers()[0].kv_scales
    assert scale != 1.0 and scale not in spec.runner.attention_layers[0].kv_scales
    outs = spec.generate(_prompts(config.vocab_size), params)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in plain]
    assert spec.speculator.stats.total_draft_tokens > 0


@torch.no_grad()
def test_without_copies_the_target_embedding_and_head_are_shared(reference, tmp_path):
    path, tensors, _, config = reference
    lean = {n: t for n, t in tensors.items() if n not in OWN_PARTS}
    ctx = _proposer_context(_with_mtp_layer(tmp_path / "lean", lean, config.num_hidden_layers))
    module = get_registries().proposers.get("mtp")(ctx).module
    params = dict(module.named_parameters())
    assert not params.keys() & set(OWN_PARTS)
    ids = torch.tensor([3, 100, 271])
    torch.testing.assert_close(module.embed(ids), ctx.target.model.embed_tokens(ids))
    x = torch.randn(3, config.hidden_size)
    torch.testing.assert_close(module.compute_logits(x),
                               ctx.target.compute_logits(module.shared_head.norm(x)))


@torch.no_grad()
def test_dummy_weights_fill_the_draft_and_leave_the_target_alone(reference):
    path = reference[0]
    ctx = _proposer_context(path, load_dummy="xavier")
    before = {n: p.clone() for n, p in ctx.target.named_parameters()}
    module = get_registries().proposers.get("mtp")(ctx).module
    assert isinstance(module, DeepseekMTP)
    assert module._borrowed_embed[0] is ctx.target.model.embed_tokens
    assert module.eh_proj.weight.abs().sum() > 0  # drawn, not left empty
    for name, p in ctx.target.named_parameters():
        assert torch.equal(p, before[name]), name


@pytest.mark.parametrize(("kind", "depth", "message"), [
    ("deepseek_v3", None, r"no multi-token-prediction weights \(model\.layers\.3\.\*\)"),
    ("deepseek_v3", 0, "num_nextn_predict_layers=0"),
    ("deepseek_v2", None, "num_nextn_predict_layers=None"),
    ("llama", None, "LlamaForCausalLM, not a DeepSeek-V2/V3 model"),
])
def test_targets_without_mtp_layers_are_refused(tmp_path, kind, depth, message):
    path = tiny_model_dir(kind)
    if depth is not None:
        path = Path(shutil.copytree(path, tmp_path / kind))
        cfg = json.loads((path / "config.json").read_text())
        cfg["num_nextn_predict_layers"] = depth
        (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        LLMEngine(str(path), method="mtp", device="cpu", enable_log_stats=False)
