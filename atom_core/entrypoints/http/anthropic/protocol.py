"""The Anthropic Messages wire format (POST /v1/messages and /v1/messages/count_tokens):
request models, response shapes and stream events.

Requests are pydantic models like the OpenAI ones (unknown fields - ``cache_control``,
``citations``, ``container``... - are accepted and ignored), with the same checks
(http/fields.py): integers within int64, and a tool's ``input_schema`` required and a JSON
schema of an object, as Anthropic requires. Lone surrogates need no check here: the body
is parsed by pydantic's JSON parser, which refuses them. Responses and events are
msgspec Structs tagged with their ``type``, so the tag is always written and always right;
sse.py's one encoder writes them. A tool_use block's ``input`` is the reader's JSON text
passed through as ``msgspec.Raw``, so it reaches the client byte for byte as parsed.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from atom_core.entrypoints.http.fields import INT64_MAX, NonEmptyStr, json_schema_problem

# ---------------------------------------------------------------------------- requests


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(b.text for b in self.content)
        return self.content or ""


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str = ""


# What each role's turn may carry, as Anthropic allows it.
UserBlock = Annotated[TextBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[
    TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


class UserMessage(_Model):
    role: Literal["user"]
    content: str | list[UserBlock]


class AssistantMessage(_Model):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


InputMessage = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class ToolDefinition(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(
        json_schema_extra={"properties": {"type": {"const": "object"}}, "required": ["type"]}
    )

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        problem = json_schema_problem(v)
        if problem:
            raise ValueError(problem)
        if v.get("type") != "object":
            raise ValueError('input_schema must describe an object: {"type": "object", ...}')
        return v


# The rule _named checks, for the document.
_NAMED_RULE: dict[str, Any] = {
    "anyOf": [
        {"properties": {"type": {"enum": ["auto", "any", "none"]}}},
        {"required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}},
    ]
}


class ToolChoice(_Model):
    model_config = ConfigDict(json_schema_extra=_NAMED_RULE)

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice {"type": "tool"} needs a name')
        return self


class ThinkingConfig(_Model):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1, le=INT64_MAX)  # accepted; the switch is on/off


class CountTokensRequest(_Model):
    """POST /v1/messages/count_tokens: what makes a message's prompt."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @property
    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "\n".join(b.text for b in self.system)
        return self.system


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages: a prompt and how to sample its reply. ``max_tokens`` is
    required, as in Anthropic's API."""

    max_tokens: int = Field(ge=1, le=INT64_MAX)
    stop_sequences: list[NonEmptyStr] | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)
    stream: bool = False
    metadata: dict[str, Any] | None = None


# --------------------------------------------------------------------------- responses


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int


class TextOut(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


class ThinkingOut(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""  # this server signs nothing; the field is part of the block's shape


class ToolUseOut(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: msgspec.Raw  # the JSON object, as the reader produced it


ContentOut = TextOut | ThinkingOut | ToolUseOut


class MessageTokensCount(msgspec.Struct, kw_only=True):
    """/v1/messages/count_tokens' answer: the tokens of the prompt /v1/messages would send."""

    input_tokens: int


class MessageOut(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: str = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


# Stream events, in Anthropic's order: message_start, per block content_block_start /
# content_block_delta... / content_block_stop, message_delta, message_stop.


class MessageStart(msgspec.Struct, kw_only=True, tag_field="type", tag="message_start"):
    message: MessageOut


class ContentBlockStart(msgspec.Struct, kw_only=True, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentOut


class TextDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJsonDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, kw_only=True, tag_field="type", tag="content_block_stop"):
    index: int


class StopInfo(msgspec.Struct, kw_only=True):
    stop_reason: str | None
    stop_sequence: str | None = None


class OutputUsage(msgspec.Struct, kw_only=True):
    output_tokens: int


class MessageDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="message_delta"):
    delta: StopInfo
    usage: OutputUsage


class MessageStop(msgspec.Struct, kw_only=True, tag_field="type", tag="message_stop"):
    pass


StreamEvent = (
    MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta
    | MessageStop
)


def event_name(event: msgspec.Struct) -> str:
    """The SSE ``event:`` line of a stream event: its ``type`` tag."""
    return type(event).__struct_config__.tag


# ------------------------------------------------------------------------------ errors

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


class ErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str


class ErrorOut(msgspec.Struct, kw_only=True, tag_field="type", tag="error"):
    error: ErrorDetail


def error_out(message: str, status: int) -> ErrorOut:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return ErrorOut(error=ErrorDetail(type=kind, message=message))
