"""How one request is sampled and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field

from atom_core.errors import InvalidRequestError
from atom_core.structured.spec import StructuredSpec

# Integers cross to the engine process (msgspec: at most 2**64 - 1) and into torch tensors
# (int64), so each is bounded to what both can hold.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class SamplingParams:
    """Per-request sampling. Defaults follow the serving guide (temperature 1, 64 tokens).

    temperature 0 is greedy. top_k <= 0 and top_p = 1 and min_p = 0 disable those filters.
    ``seed`` makes the request's samples reproducible whatever else is in the batch.
    ``stop_strings`` end generation when they appear in the text (not included in it);
    ``stop_token_ids`` end it on those tokens. Penalties follow OpenAI (presence,
    frequency: over generated tokens) and Hugging Face (repetition: over prompt and output).
    ``logprobs`` = n returns the sampled token's logprob and the top-n per generated token;
    ``prompt_logprobs`` = n does the same for every prompt token after the first.
    ``max_tokens``, ``top_k`` and stop token ids are int64s; ``seed`` is in
    torch.Generator's range, [-2**63, 2**64 - 1].
    ``structured`` constrains the output to a JSON schema, regex, choice or grammar
    (atom_core/structured): each step samples only tokens that keep the text a prefix of
    a match, and the sequence ends ("stop") once the match is complete.
    ``skip_special_tokens`` False keeps the tokenizer's special tokens in the text (a tool
    format or reasoning dialect whose markers are special tokens needs them).
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_strings: list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    structured: StructuredSpec | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop_strings, str):
            self.stop_strings = [self.stop_strings]

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """InvalidRequestError naming the first field out of range. Run once per request,
        by ``engine.validation.check_request``, not on construction: a SamplingParams is
        copied (``dataclasses.replace``) and decoded in the engine process on its way."""

        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}", param=param)

        if not self.temperature >= 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= INT64_MAX:
            raise bad("max_tokens", f"must be in [1, 2**63 - 1], got {self.max_tokens!r}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not INT64_MIN <= self.top_k <= INT64_MAX:
            raise bad("top_k", f"must be an int64, got {self.top_k!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not INT64_MIN <= self.seed <= 2**64 - 1
        ):
            raise bad("seed", f"must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise bad(name, f"must be in [-2, 2], got {value}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0 or value > 20):
                raise bad(name, f"must be an integer in [0, 20], got {value!r}")
        stops = self.stop_strings
        if stops is not None and not all(isinstance(s, str) and s for s in stops):
            raise bad("stop", "must be a list of non-empty strings")
        if not all(isinstance(t, int) and 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integers in [0, 2**63 - 1]")
        if self.structured is not None:
            self.structured.validate()
