"""Every error leaves the server in OpenAI's shape: {"error": {message, type, param, code}}.

``code`` is a string or null, as OpenAI's is: its code for the errors it has one for (a
wrong key, an unknown model, a full server, and its validation's: a missing parameter, a
wrong type, a value out of range or not among the allowed ones, an empty array), null
for the rest.

AtomError subclasses map to their status through errors.http_status; request validation
(bad JSON, wrong types, out-of-range values) is a 400 naming the offending field in
``param``; an unexpected exception is a 500 in the same shape, logged with its traceback -
reaching one from bad input is a bug (inputs are refused at validation instead).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom_core.entrypoints.http.openai.protocol import ErrorInfo, ErrorResponse
from atom_core.entrypoints.http.sse import json_response
from atom_core.errors import (
    AtomError,
    AuthenticationError,
    InvalidRequestError,
    ModelNotFoundError,
    http_status,
)

logger = logging.getLogger(__name__)

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}

# OpenAI's codes, by error class, then by status (every 429 here is a server too busy).
ERROR_CODES: dict[type[AtomError], str] = {
    AuthenticationError: "invalid_api_key",
    ModelNotFoundError: "model_not_found",
}
STATUS_CODES: dict[int, str] = {429: "rate_limit_exceeded"}
# By pydantic's error type; a bound's own type tells an integer field from a decimal one.
VALIDATION_CODES: dict[str, str] = {
    "missing": "missing_required_parameter",
    "union_tag_not_found": "missing_required_parameter",
    "literal_error": "invalid_value",
    "enum": "invalid_value",
    "union_tag_invalid": "invalid_value",
    "int_from_float": "invalid_type",
}
BOUND_CODES: dict[str, str] = {
    "greater_than": "below_min_value",
    "greater_than_equal": "below_min_value",
    "less_than": "above_max_value",
    "less_than_equal": "above_max_value",
}


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> ErrorResponse:
    error_type = ERROR_TYPES.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    code = code or STATUS_CODES.get(status)
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=code))


def error_code(exc: BaseException) -> str | None:
    if isinstance(exc, InvalidRequestError) and exc.code is not None:
        return exc.code
    return next((code for cls, code in ERROR_CODES.items() if isinstance(exc, cls)), None)


def exception_body(exc: BaseException, status: int | None = None) -> tuple[int, ErrorResponse]:
    """The status and body for ``exc``; also what a stream's error frame carries."""
    status = status or http_status(exc)
    if isinstance(exc, AtomError) or status < 500:
        message = str(exc) or type(exc).__name__
    else:
        message = f"internal server error ({type(exc).__name__})"  # internals stay in the log
    return status, error_body(message, status, getattr(exc, "param", None), error_code(exc))


def error_response(exc: BaseException, status: int | None = None) -> Response:
    status, body = exception_body(exc, status)
    return json_error(body, status)


def json_error(body: ErrorResponse, status: int) -> Response:
    return json_response(body, status)


def field_path(loc: Sequence[Any]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``.

    Pydantic puts the union member it tried into the location (``"str"``,
    ``"list[int]"``, ``"function-after[...]"``); those are dropped, they are no field.
    """
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _is_type_tag(str(part)):
            path += f".{part}" if path else str(part)
    return path or None


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in {"str", "int", "float", "bool", "dict", "list", "none"}


def validation_code(error: dict[str, Any]) -> str | None:
    """OpenAI's code for a pydantic validation error, or None."""
    kind = str(error.get("type", ""))
    if kind in BOUND_CODES:
        bound = next(iter((error.get("ctx") or {}).values()), None)
        return ("decimal_" if isinstance(bound, float) else "integer_") + BOUND_CODES[kind]
    if kind == "too_short" and isinstance(error.get("input"), list):
        return "empty_array"
    if kind.endswith(("_type", "_parsing")):
        return "invalid_type"
    return VALIDATION_CODES.get(kind)


def validation_body(errors: Sequence[dict[str, Any]]) -> ErrorResponse:
    if not errors:
        return error_body("invalid request", 400)
    first = errors[0]
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error", "malformed")
        return error_body(f"the request body is not valid JSON: {why}", 400)
    messages = []
    for err in errors[:5]:
        path = field_path(err.get("loc", ()))
        msg = str(err.get("msg")).removeprefix("Value error, ")  # our validators' own words
        messages.append(f"{path}: {msg}" if path else msg)
    param = field_path(first.get("loc", ()))
    return error_body("; ".join(messages), 400, param, validation_code(first))


async def _on_atom_error(request: Request, exc: Exception) -> Response:
    status, body = exception_body(exc)
    if status >= 500:
        logger.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
    return json_error(body, status)


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError | ValidationError)
    return json_error(validation_body(exc.errors()), 400)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return json_error(error_body(str(exc.detail), exc.status_code), exc.status_code)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    logger.error("%s %s raised", request.method, request.url.path, exc_info=exc)
    status, body = exception_body(exc, 500)
    return json_error(body, status)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can raise to an OpenAI-shaped JSON response."""
    app.add_exception_handler(AtomError, _on_atom_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(ValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(Exception, _on_unexpected)
