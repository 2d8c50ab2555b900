"""The OpenAI wire format: request models and response shapes.

Requests are pydantic models, so FastAPI validates them and a bad field comes back as a
400 naming it (http/errors.py). What would fail deeper in the server is refused there too
(http/fields.py: integers past int64, lone surrogates in text, tool parameters that are not
a JSON schema), and what OpenAI requires is required: a message's content (but on an
assistant turn that calls tools), a past tool call's id, type, name and JSON-text
arguments. The ranges SamplingParams holds are stated as field bounds, so that the OpenAPI
document shows them. Requests tolerate fields this server does not know - OpenAI clients
add new ones every release - and ignore them (kept in ``model_extra``, unread), except
the known ones that would constrain what is generated: the output constraints
(response_format, guided_*) become the request's StructuredSpec (fields.structured_spec),
the others are refused (``UNSUPPORTED``).
An explicit ``null`` means "not given" and takes the default, except ``max_tokens``,
where it means "as many as fit in the context" (what vLLM does with it).

Responses and stream chunks are msgspec Structs: every frame is encoded by sse.py's one
msgspec encoder, several times cheaper than pydantic or json.dumps per frame. Each
carries its ``object`` as a msgspec tag, so it is always written and always right.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    field_validator,
    model_validator,
)

from atom_core.entrypoints.http.fields import (
    INT64_MAX,
    Int64,
    NonEmptyStr,
    TokenId,
    check_unicode,
    field_error,
    json_schema_problem,
    structured_spec,
)
from atom_core.errors import InvalidRequestError
from atom_core.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 256  # the serving guide's default for both endpoints
MAX_N = 128  # choices per prompt; each one is an engine request, so this bounds the fan-out
MAX_LOGPROBS = 20  # OpenAI's limit, and SamplingParams'

# ---------------------------------------------------------------------------- requests


class OpenAIRequest(BaseModel):
    """Unknown fields allowed and ignored; NaN/Infinity refused (they would reach the
    sampler: an infinite temperature turns masked logits into NaN probabilities)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k == "max_tokens"}
        return data


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


class CalledFunction(BaseModel):
    """The function of a past tool call: OpenAI sends its arguments as JSON text."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    arguments: str


class AssistantToolCall(BaseModel):
    """A past tool call on an assistant turn, in OpenAI's required shape."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"]
    function: CalledFunction


class TextPart(BaseModel):
    """A content part; text is the only kind this server reads."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"] = "text"
    text: str


# The content rule below, for the document: content, or an assistant turn's tool calls.
_CONTENT_RULE: dict[str, Any] = {
    "anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {
            "required": ["role", "tool_calls"],
            "properties": {
                "role": {"const": "assistant"},
                "tool_calls": {"type": "array", "minItems": 1},
            },
        },
    ]
}


class ChatMessage(BaseModel):
    """One turn. Content parts are flattened to text here ("\\n"-joined, as vLLM does for
    string-content templates); extra keys (reasoning_content, ...) reach the template.
    Content is required, as OpenAI requires it, except on an assistant turn that calls
    tools."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_CONTENT_RULE)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator(
        "content",
        mode="before",
        json_schema_input_type=str | Annotated[list[TextPart], Field(min_length=1)] | None,
    )
    @classmethod
    def _flatten_parts(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        if not v:
            raise ValueError("content parts must not be an empty list")
        texts = []
        for part in v:
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise ValueError('content parts must be objects {"type": "text", "text": ...}')
            if part.get("type", "text") != "text":
                raise ValueError(f"content part type {part['type']!r} is not supported (text only)")
            texts.append(part["text"])
        return "\n".join(texts)

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            need = "content or tool_calls" if self.role == "assistant" else "content"
            raise field_error(
                type(self).__name__, ("content",), f"a message of role {self.role!r} needs {need}",
                None,
            )
        return self


class FunctionDefinition(BaseModel):
    """A tool's function. ``parameters`` must be a JSON schema (OpenAI checks it too)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        problem = None if v is None else json_schema_problem(v)
        if problem:
            raise ValueError(problem)
        return v


class ChatTool(BaseModel):
    """One entry of ``tools``, in OpenAI's shape."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


def _checked_tool(value: Any) -> dict[str, Any]:
    ChatTool.model_validate(value)  # its errors are located inside the tool
    return value


# A tool stays the client's dict, every key as sent: the chat template and the tool parser
# read dicts. It is validated, and documented, as a ChatTool.
ToolDict = Annotated[dict[str, Any], PlainValidator(_checked_tool, json_schema_input_type=ChatTool)]


def _always(value: Any) -> bool:
    return True


def _asks_for_more_than_text(value: Any) -> bool:
    return not (isinstance(value, list) and set(value) <= {"text"})


# Fields that constrain or bias what is generated, which this server does not implement:
# OpenAI's and vLLM's spellings. Ignored like other unknown fields, each would return
# output the client did not ask for (tokens it banned), so a value that asks for something
# is a 400 naming the field. Each entry's function says whether a value asks for anything:
# an empty logit_bias does not.
UNSUPPORTED: dict[str, Any] = {
    "logit_bias": bool,
    "logits_processors": bool,
    "min_tokens": bool,  # vLLM's: no EOS or stop before that many tokens
    # Output in other modalities (OpenAI's audio replies).
    "modalities": _asks_for_more_than_text,
    "audio": _always,
}
# The completions endpoint's own: suffix (text after the insertion point). Its best_of is a
# declared field, refused unless it equals n (CompletionRequest.to_sampling_params).
UNSUPPORTED_COMPLETIONS: dict[str, Any] = {
    **UNSUPPORTED,
    "suffix": bool,
}


class _SamplingRequest(OpenAIRequest):
    """Fields both endpoints share."""

    unsupported_fields: ClassVar[dict[str, Any]] = UNSUPPORTED

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)  # -1 (or 0) = off; bounded: it becomes a tensor
    min_p: float = Field(0.0, ge=0, le=1)
    stop: list[NonEmptyStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens in the text
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    # int64, as OpenAI and vLLM take it; choice j's seed + j stays in torch.Generator's
    # range, which goes up to 2**64 - 1 (http/generation.choice_params).
    seed: Int64 | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return check_unicode(cls.__name__, data)

    @field_validator(
        "stop", mode="before", json_schema_input_type=NonEmptyStr | list[NonEmptyStr] | None
    )
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v or None
        raise ValueError("stop must be a string or a list of strings")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _refuse_unsupported(self) -> None:
        """A 400 for the first ``unsupported_fields`` entry whose value asks for something."""
        for name, value in (self.model_extra or {}).items():
            asks = self.unsupported_fields.get(name)
            if asks is not None and asks(value):
                raise InvalidRequestError(
                    f"{name} is not supported by this server; leave it out (the output "
                    "would not honour it)",
                    param=name,
                )

    def _params(self, max_tokens: int, **kw: Any) -> SamplingParams:
        self._refuse_unsupported()
        return SamplingParams(
            structured=structured_spec(self.model_extra or {}),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            stop_strings=self.stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            **kw,
        )


def _check_max_tokens(value: int, param: str, least: int = 1) -> None:
    if value < least:
        raise InvalidRequestError(f"{param} must be at least {least}, got {value}", param=param)


class ThinkingSwitch(BaseModel):
    """``{"type": "enabled" | "disabled"}``; other keys (budget_tokens) are accepted."""

    model_config = ConfigDict(extra="allow")

    type: Literal["enabled", "disabled"]


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions. ``prompt`` is accepted as an alias of ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = DEFAULT_MAX_TOKENS
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # OpenAI's newer name; wins over max_tokens
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    tools: list[ToolDict] | None = None  # passed to the chat template
    # The reader's ToolPolicy ("none" without tools); an object names a function.
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # False: at most one call dispatched (ToolPolicy.parallel)
    # vLLM's: how the prompt ends (chat.prompt_ending). A new assistant turn opened for the
    # reply, or the final assistant message continued (a prefill; needs the former false).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # The thinking switch in the spellings clients send: Qwen/DashScope's top-level
    # enable_thinking, and {"type": "enabled" | "disabled"} (Anthropic, DeepSeek, Kimi).
    # Answered in the prompt through the template's own switch (chat.py).
    enable_thinking: bool | None = None
    thinking: bool | ThinkingSwitch | None = None

    @property
    def thinking_requested(self) -> bool | None:
        """True/False when the client switched thinking on/off, None to leave the model's
        default alone. {"type": "disabled"} is a non-empty object, so it is read, not tested
        for truth."""
        if isinstance(self.thinking, ThinkingSwitch):
            return self.thinking.type == "enabled"
        if self.thinking is not None:
            return self.thinking
        return self.enable_thinking

    @model_validator(mode="before")
    @classmethod
    def _prompt_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "prompt" in data:
            data = dict(data)
            prompt = data.pop("prompt")
            data.setdefault("messages", prompt)
        return data

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """``default_max_tokens`` is used when the client sent ``max_tokens: null`` (the
        handler passes max_model_len: generation stops where the context ends)."""
        if self.max_completion_tokens is not None:
            max_tokens, param = self.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = self.max_tokens, "max_tokens"
        if max_tokens is None:
            max_tokens = default_max_tokens
        _check_max_tokens(max_tokens, param)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs"
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs=logprobs)


Prompt = str | list[Int64]  # one completions prompt: text or token ids
# What a client may send as ``prompt``, for the document: one prompt or a batch.
_PROMPT_INPUT = (
    str
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. ``prompt`` is normalised to a list of prompts (batch): a
    string, a list of strings, a list of token ids or a list of token-id lists. Each
    prompt gets ``n`` choices; choice index = prompt_index * n + j (OpenAI's order)."""

    unsupported_fields: ClassVar[dict[str, Any]] = UNSUPPORTED_COMPLETIONS

    prompt: list[Prompt]
    max_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = DEFAULT_MAX_TOKENS  # 0: echo
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True  # vLLM's extension: BOS etc. on text prompts
    best_of: Int64 | None = None  # only best_of == n (one candidate per returned choice)

    @field_validator("prompt", mode="before", json_schema_input_type=_PROMPT_INPUT)
    @classmethod
    def _prompt_batch(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v):
                return v
            if all(_is_token_id(t) for t in v):
                return [v]
            if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in v):
                return v
        raise ValueError(
            "prompt must be a string, a non-empty list of strings, a list of token ids "
            "or a list of non-empty token-id lists"
        )

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: only the prompt comes back. The engine cannot run zero
        steps, so the handler generates one token and drops it (its prompt logprobs are
        computed on the way)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(
                f"best_of {self.best_of} is not supported: each choice is one candidate "
                f"(best_of = n = {self.n})",
                param="best_of",
            )
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        if self.echo_only:
            max_tokens = 1
        _check_max_tokens(max_tokens, "max_tokens", least=1)
        prompt_logprobs = self.logprobs if self.echo else None
        return self._params(max_tokens, logprobs=self.logprobs, prompt_logprobs=prompt_logprobs)


def _is_token_id(t: Any) -> bool:
    """An integer, or a float with an integral value: JSON Schema's integer, and what
    pydantic takes for every other integer field (1.0, not 1.5)."""
    if isinstance(t, bool):
        return False
    return isinstance(t, int) or (isinstance(t, float) and t.is_integer())


# --------------------------------------------------------------------------- responses


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    latency_s: float = 0.0


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # a JSON object, as text


class ChatToolCall(msgspec.Struct, kw_only=True, tag_field="type", tag="function"):
    id: str
    function: FunctionCall


class ChatMessageOut(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCall] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string / token that ended it (vLLM's field)


class ChatCompletionResponse(
    msgspec.Struct, kw_only=True, tag_field="object", tag="chat.completion"
):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class FunctionDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ChatToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed call: first index, id, type and name (arguments ""), then its arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(
    msgspec.Struct,
    kw_only=True,
    omit_defaults=True,
    tag_field="object",
    tag="chat.completion.chunk",
):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None  # only on the include_usage chunk, whose choices is []


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """The legacy shape lm-eval reads. top_logprobs entries map token text to logprob and
    include the chosen token (so up to n + 1 keys); a prompt's first token has no logprob
    (null in token_logprobs and top_logprobs). text_offset indexes the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True, tag_field="object", tag="text_completion"):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(
    msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="object", tag="text_completion"
):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TokenizerInfo(msgspec.Struct, kw_only=True):
    """The tokenizer's entry in the /v1/models card: what a client needs besides /tokenize
    and /detokenize to build prompts with the served tokenizer (``atom bench serve``
    without --tokenizer): its base vocabulary (ids below ``vocab_size``), which of those
    are special, and whether a chat template renders the chat form."""

    vocab_size: int
    special_ids: list[int]
    chat_template: bool


class ModelCard(msgspec.Struct, kw_only=True, tag_field="object", tag="model"):
    id: str
    created: int
    owned_by: str = "atom"
    root: str
    max_model_len: int
    tokenizer: TokenizerInfo


class ModelList(msgspec.Struct, kw_only=True, tag_field="object", tag="list"):
    data: list[ModelCard]


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None  # OpenAI's: a string where it has one for the error, else null


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorInfo
