"""The ``eagle3`` method on a tiny random EAGLE-3 draft (published layout) beside the tiny
Llama (fp32, CPU).

The draft's numbers are checked against a plain torch reference written here from the
method's description, over the target's layer inputs as transformers reports them; the
engine's drafts (through prefix caching, chunked prefill and preemption) against that
reference run from scratch on each sequence's history; greedy output against the engine
without speculation; and the checks the factory makes on a draft that does not fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from atom_models_llama.eagle3 import Eagle3Draft, load_eagle3
from safetensors.torch import save_file

from atom_core.config import Config, ConfigError
from atom_core.engine.llm_engine import LLMEngine
from atom_core.layers.context import forward_context
from atom_core.loader import load_model
from atom_core.sampling_params import SamplingParams
from atom_core.spec_decode.proposer import ProposerContext
from atom_core.testing.paged_kv import PagedKV, allocate_kv_caches
from atom_core.testing.tiny_models import VOCAB_SIZE, hf_model, tiny_model_dir

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 4, 2, 16, 96
DRAFT_VOCAB = 128
EPS = 1e-5
ROPE_THETA = 50000.0  # the draft's own, not the target's
AUX_IDS = [1, 0, 1]  # the tiny target has 2 layers; read in layer order: 0, 1, 1
LAYERS = sorted(AUX_IDS)


@dataclass
class Draft:
    path: Path
    weights: dict[str, torch.Tensor]
    rope_theta: float


def write_draft(path: Path, vocab: int = VOCAB_SIZE, fc_inputs: int = 3 * HIDDEN,
                aux_ids: list[int] | None = AUX_IDS, seed: int = 0,
                induction: torch.Tensor | None = None) -> Draft:
    """An EAGLE-3 draft directory (config.json, model.safetensors) of random weights, or,
    given the target's embedding, of ``induction_weights``."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    def norm() -> torch.Tensor:
        return torch.rand(HIDDEN, generator=g) + 0.5

    ids = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
        "fc.weight": w(HIDDEN, fc_inputs) * 4,  # the layer inputs are small
        "norm.weight": norm(),
        "lm_head.weight": w(DRAFT_VOCAB, HIDDEN),
        "d2t": ids - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }
    theta = ROPE_THETA
    if induction is not None:
        tensors.update(induction_weights(induction, ids, g))
        theta = 1e40  # all but each head's first rotary pair stand still
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": 1,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "hidden_act": "silu",
        "rms_norm_eps": EPS, "rope_theta": theta, "vocab_size": vocab,
        "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False,
        "max_position_embeddings": 32,  # shorter than the sequences: the target's serves
    }
    if aux_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return Draft(path, tensors, theta)


def induction_weights(embed: torch.Tensor, ids: torch.Tensor,
                      g: torch.Generator) -> dict[str, torch.Tensor]:
    """A draft that continues a repeat, so the engine accepts some of its drafts. Row r
    reads token x[r + 1] and, through fc, the target's first layer input: embed(x[r]).
    Its key is x[r] and its value x[r + 1]; the query of row p is x[p + 1], so it finds
    the rows r where x[r] == x[p + 1] and takes what followed there. The head scores draft
    ids by those values. Each head's first rotary pair (the one that turns fast) is left
    empty, and the draft's rope_theta is vast, so position does not blur the match."""
    h, group = HIDDEN, HEADS // KV_HEADS
    usable = [d for d in range(HEAD_DIM) if d % (HEAD_DIM // 2)]
    wq = torch.zeros(HEADS * HEAD_DIM, 2 * h)
    wk = torch.zeros(KV_HEADS * HEAD_DIM, 2 * h)
    wv = torch.zeros(KV_HEADS * HEAD_DIM, 2 * h)
    wo = torch.zeros(h, HEADS * HEAD_DIM)
    values = torch.randn(KV_HEADS * HEAD_DIM, h, generator=g) / h**0.5
    for kv in range(KV_HEADS):
        proj = torch.randn(len(usable), h, generator=g) / h**0.5
        wk[[kv * HEAD_DIM + d for d in usable], h:] = proj  # hidden_norm(embed at p)
        wv[kv * HEAD_DIM : (kv + 1) * HEAD_DIM, :h] = values[kv * HEAD_DIM : (kv + 1) * HEAD_DIM]
        for head in range(kv * group, (kv + 1) * group):
            wq[[head * HEAD_DIM + d for d in usable], :h] = 8.0 * proj  # the token at p + 1
            wo[kv * HEAD_DIM : (kv + 1) * HEAD_DIM, head * HEAD_DIM : (head + 1) * HEAD_DIM] = (
                torch.eye(HEAD_DIM) / group)
    fc = torch.zeros(h, 3 * h)
    fc[:, :h] = torch.eye(h)
    normed = embed[ids] * torch.rsqrt(embed[ids].pow(2).mean(-1, keepdim=True) + EPS)
    head = torch.zeros(DRAFT_VOCAB, h)
    head[:, : KV_HEADS * HEAD_DIM] = normed @ values.T
    return {
        "midlayer.self_attn.q_proj.weight": wq, "midlayer.self_attn.k_proj.weight": wk,
        "midlayer.self_attn.v_proj.weight": wv, "midlayer.self_attn.o_proj.weight": wo,
        "midlayer.mlp.down_proj.weight": torch.randn(h, INTERMEDIATE, generator=g) * 0.01,
        "fc.weight": fc, "lm_head.weight": head,
        **{name: torch.ones(h) for name in ("midlayer.input_layernorm.weight",
                                            "midlayer.hidden_norm.weight",
                                            "midlayer.post_attention_layernorm.weight",
                                            "norm.weight")},
    }


# --- the reference, from the method's description ----------------------------------------

def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style RoPE of [T, heads, d] at positions 0 .. T - 1."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angle = torch.arange(x.shape[0]).float()[:, None, None] * inv
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)


@torch.no_grad()
def reference_draft(draft: Draft, embed: torch.Tensor, tokens: list[int],
                    hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows at positions 0 .. T - 1 (token, hidden) -> (normed, pre-norm sum)."""
    n, t, theta = len(tokens), draft.weights, draft.rope_theta
    m = {k.removeprefix("midlayer."): v for k, v in t.items()}
    x = torch.cat([rms(embed[tokens], m["input_layernorm.weight"]),
                   rms(hidden, m["hidden_norm.weight"])], -1)
    q = rotate((x @ m["self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), theta)
    k = rotate((x @ m["self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), theta)
    v = (x @ m["self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = (z.repeat_interleave(HEADS // KV_HEADS, dim=1) for z in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    h = attn @ m["self_attn.o_proj.weight"].T + hidden
    y = rms(h, m["post_attention_layernorm.weight"])
    s = (F.silu(y @ m["mlp.gate_proj.weight"].T) * (y @ m["mlp.up_proj.weight"].T)) \
        @ m["mlp.down_proj.weight"].T + h
    return rms(s, t["norm.weight"]), s


def reference_target_hidden(hf, draft: Draft, tokens: list[int]) -> torch.Tensor:
    """fc over the target's layer inputs, as transformers reports them."""
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in LAYERS], -1) @ draft.weights["fc.weight"].T


@torch.no_grad()
def reference_drafts(draft: Draft, embed: torch.Tensor, history: list[int],
                     target_hidden: torch.Tensor, n: int) -> list[int]:
    """The n drafts after ``history``: rows (token p + 1, ``target_hidden`` p), then each
    draft with the pre-norm sum of the row before it."""
    t = draft.weights
    ids = torch.arange(DRAFT_VOCAB) + t["d2t"]
    tokens, hidden = history[1:], target_hidden[: len(history) - 1]
    drafts: list[int] = []
    for _ in range(n):
        normed, pre = reference_draft(draft, embed, tokens, hidden)
        drafts.append(int(ids[(normed[-1] @ t["lm_head.weight"].T).argmax()]))
        tokens, hidden = tokens + drafts[-1:], torch.cat([hidden, pre[-1:]])
    return drafts


# --- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf():
    return hf_model("llama")


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory) -> Draft:
    return write_draft(tmp_path_factory.mktemp("eagle3-random"))


@pytest.fixture(scope="module")
def induction_draft(tmp_path_factory, hf) -> Draft:
    embed = hf.model.embed_tokens.weight.detach()
    return write_draft(tmp_path_factory.mktemp("eagle3-induction"), induction=embed)


@pytest.fixture(scope="module")
def target():
    return load_model(Config.from_kwargs(model=str(tiny_model_dir("llama"))), "cpu",
                      torch.float32)


def load_draft(target, path: Path) -> Eagle3Draft:
    config = Config.from_kwargs(model=str(tiny_model_dir("llama")), method="eagle3",
                                draft_model=str(path))
    ctx = ProposerContext(config, target.model, target.hf_config, torch.device("cpu"),
                          torch.float32)
    return load_eagle3(ctx)


# --- the network ---------------------------------------------------------------------------

def test_forward_equals_the_reference_over_prefill_and_decode(target, random_draft, hf):
    draft = load_draft(target, random_draft.path)
    assert target.model.model.aux_hidden_layers == (0, 1, 1)
    kv = PagedKV(num_blocks=16, block_size=4)
    allocate_kv_caches(draft, kv)
    seq = kv.add_sequence()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB_SIZE, (13,), generator=g).tolist()
    hidden = torch.randn(13, HIDDEN, generator=g)
    normed, pre = [], []
    for start, end in ((0, 9), (9, 10), (10, 13)):  # a prefill, a decode, a verify-sized run
        if start == 9:  # a draft step reads the row before's pre-norm sum
            hidden[9] = pre[-1][-1]
        meta, positions = kv.step([seq], [end - start])
        with torch.no_grad(), forward_context(meta):
            a, b = draft.forward(torch.tensor(tokens[start:end]), positions, hidden[start:end])
        normed.append(a)
        pre.append(b)
    embed = hf.model.embed_tokens.weight
    want_normed, want_pre = reference_draft(random_draft, embed, tokens, hidden)
    torch.testing.assert_close(torch.cat(normed), want_normed, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(pre), want_pre, rtol=1e-4, atol=1e-4)

    # The first step's hidden input: fc over the inputs of target layers 0, 1, 1.
    kv = PagedKV(num_blocks=16, block_size=4)
    allocate_kv_caches(target.model, kv)
    meta, positions = kv.step([kv.add_sequence()], [len(tokens)])
    with torch.no_grad(), forward_context(meta):
        got = draft.target_hidden(target.model(torch.tensor(tokens), positions))
    torch.testing.assert_close(got, reference_target_hidden(hf, random_draft, tokens),
                               rtol=1e-4, atol=1e-5)


def test_d2t_puts_the_draft_argmax_on_its_target_id(target, random_draft):
    draft = load_draft(target, random_draft.path)
    h = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = draft.compute_logits(h)
    ids = torch.arange(DRAFT_VOCAB) + random_draft.weights["d2t"]
    assert not torch.equal(ids, torch.arange(DRAFT_VOCAB)) and int(ids.max()) > DRAFT_VOCAB
    small = h @ random_draft.weights["lm_head.weight"].T
    assert logits.shape == (6, VOCAB_SIZE)
    torch.testing.assert_close(logits[:, ids], small)
    assert torch.isneginf(logits).sum(-1).tolist() == [VOCAB_SIZE - DRAFT_VOCAB] * 6
    assert logits.argmax(-1).tolist() == ids[small.argmax(-1)].tolist()


# --- in the engine -------------------------------------------------------------------------

def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    out = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (14, 9, 22, 30, 11)]
    # Shares 10 tokens with the first: it parts mid-block (block_size 4), so no cached
    # block's last draft row was computed with a token this sequence does not have.
    return out + [out[0][:10] + [7, 7, 8, 9, 10]]


PROMPTS = _prompts()
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
          for n in (30, 17, 25, 36, 21, 28)]
ENGINE = dict(enable_log_stats=False, device="cpu", block_size=4, enable_prefix_caching=True,
              max_num_batched_tokens=16, num_gpu_blocks_override=36, max_model_len=96,
              max_num_seqs=6)


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    engine = LLMEngine(str(tiny_model_dir("llama")), **ENGINE)
    return [o["token_ids"] for o in engine.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("buffers", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_equals_plain_and_drafts_equal_the_reference(k, buffers,
                                                                   induction_draft, hf, plain):
    """``buffers``: decode and verify steps as decode rows in the GPU path's static buffers
    (eagerly here), the drafts picked and placed on the device after verification."""
    spec = LLMEngine(str(tiny_model_dir("llama")), method="eagle3",
                     draft_model=str(induction_draft.path), num_speculative_tokens=k, **ENGINE)
    if buffers:
        spec.runner.fast_decode = True
        spec.runner._setup_fast_decode()
    proposed: list[tuple[list[int], list[int]]] = []  # (history, its drafts)
    take = spec.speculator.take

    def recording(seqs, drafts):
        proposed.extend((list(s.token_ids), drafts[s.seq_id]) for s in seqs
                        if drafts.get(s.seq_id))
        take(seqs, drafts)

    spec.speculator.take = recording
    outs = [o["token_ids"] for o in spec.generate(PROMPTS, PARAMS)]
    assert outs == plain
    assert spec.num_preemptions > 0
    stats = spec.speculator.stats
    assert stats.total_draft_tokens > 0 and stats.total_accepted_tokens > 0
    assert k == 1 or stats.accepted_per_position[1] > 0  # runs of accepted drafts, too
    assert len(proposed) > 30 and max(len(d) for _, d in proposed) == k
    # Each history is a prefix of its sequence's final tokens, and all here is causal.
    finals = [p + o for p, o in zip(PROMPTS, plain, strict=True)]
    hidden = [reference_target_hidden(hf, induction_draft, f) for f in finals]
    embed = hf.model.embed_tokens.weight
    for history, drafts in proposed:
        i = next(i for i, f in enumerate(finals) if f[: len(history)] == history)
        want = reference_drafts(induction_draft, embed, history, hidden[i], len(drafts))
        assert drafts == want, history
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def test_fp8_kv_cache_scales_of_the_draft_are_measured(induction_draft):
    """``--calculate-kv-scales``: the draft layer reads the calibration text beside the
    target (the layers the target keeps) and gets scales of its own; greedy output stays the
    plain fp8 engine's, with drafts accepted."""
    fp8 = dict(ENGINE, kv_cache_dtype="fp8", calculate_kv_scales=True)
    plain = LLMEngine(str(tiny_model_dir("llama")), **fp8).generate(PROMPTS, PARAMS)
    spec = LLMEngine(str(tiny_model_dir("llama")), method="eagle3",
                     draft_model=str(induction_draft.path), num_speculative_tokens=2, **fp8)
    (layer,) = spec.runner.drafter.attention_layers()
    assert all(s != 1.0 for s in layer.kv_scales), layer.kv_scales
    outs = spec.generate(PROMPTS, PARAMS)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in plain]
    assert spec.speculator.stats.total_accepted_tokens > 0


def test_dummy_weights_build_the_draft_from_its_config(random_draft):
    spec = LLMEngine(str(tiny_model_dir("llama")), method="eagle3", load_dummy="xavier",
                     draft_model=str(random_draft.path), num_speculative_tokens=2,
                     **{**ENGINE, "enable_prefix_caching": False})
    outs = spec.generate(PROMPTS[:2], PARAMS[:2])
    assert [len(o["token_ids"]) for o in outs] == [30, 17]
    assert spec.speculator.stats.total_draft_tokens > 0


# --- drafts that do not fit ----------------------------------------------------------------

def test_eagle3_needs_a_draft_model():
    with pytest.raises(ConfigError, match="--method eagle3 needs --draft-model"):
        LLMEngine(str(tiny_model_dir("llama")), device="cpu", method="eagle3")


@pytest.mark.parametrize(("kw", "message"), [
    ({"vocab": 300}, "has a vocabulary of 300 tokens, the target 272"),
    ({"fc_inputs": 2 * HIDDEN}, "fc takes 128 inputs; the target's hidden size 64 x 3"),
    ({"aux_ids": None}, r"inputs of target layers \[2, 1, -1\]; the target has 2 layers"),
])
def test_a_draft_that_does_not_fit_the_target_is_refused(target, tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message):
        load_draft(target, write_draft(tmp_path, **kw).path)
