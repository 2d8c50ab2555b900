"""The one check of a request before it is queued: its prompt against the context and the
vocabulary, then its SamplingParams.

Each request passes ``check_request`` once. LLMEngine.add_request runs it; the server runs
it in the request's handler, so that a refusal is a 400 before any byte of a stream, and
the engine process, which only the server's frontend feeds, runs none.

Nothing is clipped silently: a prompt that fills the context is refused, and
``max_tokens`` beyond what the context has left is accepted - generation then stops at
max_model_len with finish_reason "length".
"""

from __future__ import annotations

from collections.abc import Sequence

from atom_core.errors import InvalidRequestError
from atom_core.sampling_params import SamplingParams


def context_error(
    max_model_len: int, num_tokens: int, param: str, at_least: bool = False
) -> InvalidRequestError:
    """The refusal of a prompt that leaves no room to generate (OpenAI's words)."""
    has = f"at least {num_tokens}" if at_least else str(num_tokens)
    return InvalidRequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt has {has} tokens, which leaves no room to generate one.",
        param=param, code="context_length_exceeded",
    )


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    max_model_len: int,
    vocab_size: int,
    param: str = "prompt",
) -> None:
    """InvalidRequestError for the first thing wrong with a request, naming ``param`` for
    the prompt's faults. ``vocab_size`` bounds the ids: the model's vocabulary, which a
    tokenizer named by --tokenizer may exceed, so text prompts are checked too."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", param=param)
    if n >= max_model_len:
        raise context_error(max_model_len, n, param)
    ids = prompt_token_ids
    if min(ids) < 0 or max(ids) >= vocab_size:  # C-speed scans
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise InvalidRequestError(
            f"token id {bad} is not in the vocabulary [0, {vocab_size})", param=param
        )
    params.validate()
