"""The API's OpenAPI document (/openapi.json), made to say what the server answers.

FastAPI's own document is right about the request bodies it validates and wrong or silent
about the rest: it promises 422 for a validation error (the server answers 400, see
errors.py), has no schema for any reply (the handlers return msgspec-encoded
responses), and no request body where the handler parses the body itself: /v1/messages
and its count_tokens (so that their errors are Anthropic's) and /tokenize (which tells its
two forms apart by their keys). ``install_openapi`` serves FastAPI's document corrected:

- every operation lists the error statuses it can answer, each with its API's error body
  (Anthropic's on /v1/messages, OpenAI's elsewhere), and no 422;
- a 200's body is the JSON schema of the Struct the handler encodes (msgspec's); a
  generation route may also answer text/event-stream (``stream: true``), whose events are
  described one by one, as OpenAPI 3.1 reads an event stream's schema: each event's
  ``data`` is JSON text (``contentMediaType``) of one of the route's stream Structs or of
  its error body, or OpenAI's closing ``[DONE]``;
- those routes take their request models (REQUEST_BODIES).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from atom_core.entrypoints.http.anthropic.protocol import (
    CountTokensRequest,
    ErrorOut,
    MessageOut,
    MessagesRequest,
    MessageTokensCount,
    StreamEvent,
)
from atom_core.entrypoints.http.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from atom_core.entrypoints.http.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

REF = "#/components/schemas/{name}"
REQUEST_MODELS = (
    ChatCompletionRequest, CompletionRequest, MessagesRequest, CountTokensRequest,
    TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest,
)  # fmt: skip
# The request bodies of the routes whose handler parses the body: any one of these models.
REQUEST_BODIES: dict[str, tuple[str, ...]] = {
    "/v1/messages": ("MessagesRequest",),
    "/v1/messages/count_tokens": ("CountTokensRequest",),
    "/tokenize": ("TokenizeCompletionRequest", "TokenizeChatRequest"),
}

# Why each status may come back; every generation route can answer each of these.
STATUS_TEXT: dict[int, str] = {
    400: "Invalid request: a malformed body or a value out of range; `param` names the field",
    401: "Missing or wrong API key (when the server was started with --api-key)",
    404: "The model named is not served here",
    413: "Request body larger than --max-request-body-bytes",
    429: "--max-queued-requests requests are already waiting (see Retry-After)",
    503: "The engine is not running",
    504: "The request ran past --request-timeout; its generation was aborted",
}
GENERATION_ERRORS = (400, 401, 404, 413, 429, 503, 504)
# Answered by the frontend alone: no queue, no engine.
TOKENIZER_ERRORS = (400, 401, 404, 413)


@dataclass(frozen=True)
class Answers:
    """What one route answers: its 200 body (a Struct, or an inline JSON schema), the
    Structs its stream's events carry (none: it does not stream), its error statuses and
    whose error shape they have."""

    ok: type[msgspec.Struct] | dict[str, Any] | None
    errors: tuple[int, ...] = ()
    events: tuple[type[msgspec.Struct], ...] = ()
    anthropic: bool = False
    media_type: str = "application/json"


_STATUS_OK = {"type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]}
_MTP_STATS = {  # speculative decoding's acceptance; only "enabled" without --method
    "type": "object",
    "properties": {
        "enabled": {"type": "boolean"},
        "total_draft_tokens": {"type": "integer"},
        "total_accepted_tokens": {"type": "integer"},
        "acceptance_rate": {"type": "number"},
        "average_tokens_per_forward": {"type": "number"},
        "num_verifications": {"type": "integer"},
        "acceptance_per_position": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["enabled"],
}
_PROFILE_OK = {
    "type": "object",
    "properties": {"status": {"const": "ok"}, "message": {"type": "string"}},
    "required": ["status", "message"],
}

ROUTES: dict[str, Answers] = {
    "/v1/chat/completions": Answers(
        ChatCompletionResponse, GENERATION_ERRORS, events=(ChatCompletionChunk,)
    ),
    "/v1/completions": Answers(CompletionResponse, GENERATION_ERRORS, events=(CompletionChunk,)),
    "/v1/messages": Answers(
        MessageOut, GENERATION_ERRORS, events=get_args(StreamEvent), anthropic=True
    ),
    "/v1/messages/count_tokens": Answers(MessageTokensCount, TOKENIZER_ERRORS, anthropic=True),
    "/tokenize": Answers(TokenizeResponse, TOKENIZER_ERRORS),
    "/detokenize": Answers(DetokenizeResponse, TOKENIZER_ERRORS),
    "/v1/models": Answers(ModelList, (401, 503)),
    "/health": Answers(_STATUS_OK, (503,)),
    "/version": Answers(
        {"type": "object", "properties": {"version": {"type": "string"}}, "required": ["version"]}
    ),
    "/metrics": Answers({"type": "string"}, media_type="text/plain"),
    "/debug/mtp_stats": Answers(_MTP_STATS),
    "/start_profile": Answers(_PROFILE_OK, (400, 401, 503)),
    "/stop_profile": Answers(_PROFILE_OK, (400, 401, 503)),
}


def api_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document for ``app``, corrected as the module docstring says. A route
    missing from ROUTES keeps FastAPI's 200 and gets the 400/401 every route can answer."""
    doc = get_openapi(
        title=app.title, version=app.version, openapi_version=app.openapi_version,
        description=app.description, routes=app.routes,
    )  # fmt: skip
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # the 422's, never sent
        schemas.pop(name, None)
    # The request models' schemas as pydantic writes them: FastAPI's pass through its
    # OpenAPI model, which makes every bound a float (2**63 - 1 becomes 2.0**63).
    _, requests = models_json_schema(
        [(model, "validation") for model in REQUEST_MODELS],
        ref_template=REF.replace("{name}", "{model}"),
    )
    schemas.update(requests["$defs"])
    structs = [ErrorResponse, ErrorOut]
    for answers in ROUTES.values():
        structs += [answers.ok] if isinstance(answers.ok, type) else []
        structs += answers.events
    _add_schemas(schemas, msgspec.json.schema_components(structs, ref_template=REF)[1])

    for path, operations in doc["paths"].items():
        answers = ROUTES.get(path, Answers(None, (400, 401)))
        for operation in operations.values():
            if path in REQUEST_BODIES:
                operation["requestBody"] = _json_body(REQUEST_BODIES[path])
            operation["responses"] = _responses(answers, operation["responses"])
    return doc


def install_openapi(app: FastAPI) -> None:
    """Serve ``api_document(app)`` at /openapi.json (built once, on the first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = api_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override


def _responses(answers: Answers, fastapi: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    error_name = "ErrorOut" if answers.anthropic else "ErrorResponse"
    if answers.ok is None:
        out["200"] = fastapi["200"]
    else:
        schema = _ref(answers.ok.__name__) if isinstance(answers.ok, type) else answers.ok
        content = {answers.media_type: {"schema": schema}}
        if answers.events:
            names = [*(struct.__name__ for struct in answers.events), error_name]
            content["text/event-stream"] = {"schema": _sse_event(names, not answers.anthropic)}
        out["200"] = {"description": "Successful Response", "content": content}
    error = _ref(error_name)
    for status in answers.errors:
        out[str(status)] = {
            "description": STATUS_TEXT[status],
            "content": {"application/json": {"schema": error}},
        }
    return out


def _sse_event(names: list[str], done: bool) -> dict[str, Any]:
    """One server-sent event whose data is JSON of one of ``names``, or ``[DONE]``."""
    data: dict[str, Any] = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(name) for name in names]},
    }
    if done:
        data = {"anyOf": [{"const": "[DONE]"}, data]}
    return {
        "type": "object",
        "properties": {"event": {"type": "string"}, "data": data},
        "required": ["data"],
    }


def _json_body(names: tuple[str, ...]) -> dict[str, Any]:
    # anyOf, not oneOf: a body may fit several (their unknown fields are allowed).
    schema = _ref(names[0]) if len(names) == 1 else {"anyOf": [_ref(n) for n in names]}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(name=name)}


def _add_schemas(schemas: dict[str, Any], new: dict[str, Any]) -> None:
    """Add components; two different schemas under one name would make refs ambiguous."""
    for name, schema in new.items():
        if schemas.setdefault(name, schema) != schema:
            raise RuntimeError(f"two OpenAPI schemas are named {name}")
