"""Perplexity of a fixed public-domain text through the engine: the yardstick of the
quantized formats' tests (fp8 KV cache, fp8 weights)."""

from __future__ import annotations

import math

from atom_core.engine.llm_engine import LLMEngine
from atom_core.sampling_params import SamplingParams

# Lewis Carroll, "Alice's Adventures in Wonderland" (1865), chapter I: public domain.
TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of "
    "having nothing to do: once or twice she had peeped into the book her sister was "
    "reading, but it had no pictures or conversations in it, 'and what is the use of a "
    "book,' thought Alice 'without pictures or conversations?' So she was considering in "
    "her own mind (as well as she could, for the hot day made her feel very sleepy and "
    "stupid), whether the pleasure of making a daisy-chain would be worth the trouble of "
    "getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran "
    "close by her. There was nothing so very remarkable in that; nor did Alice think it so "
    "very much out of the way to hear the Rabbit say to itself, 'Oh dear! Oh dear! I shall "
    "be late!'"
)
CHUNKED = dict(enable_log_stats=False, device="cpu", max_num_batched_tokens=32,
               max_model_len=512, block_size=16)


def perplexity(engine: LLMEngine, prompt: str | list[int]) -> float:
    """exp of the mean negative log-likelihood of the prompt's tokens after the first."""
    out = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    lps = [entry.logprob for entry in out["prompt_logprobs"] if entry is not None]
    assert len(lps) == len(engine.tokenize(prompt)) - 1
    return math.exp(-sum(lps) / len(lps))
