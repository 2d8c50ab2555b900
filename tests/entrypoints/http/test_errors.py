"""The error body: OpenAI's shape, its type by status and its code by error."""

from __future__ import annotations

import pytest

from atom_core.entrypoints.http.errors import error_body, exception_body
from atom_core.errors import (
    AuthenticationError,
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
)


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (AuthenticationError("no key"), 401, "invalid_api_key"),
        (ModelNotFoundError("no model"), 404, "model_not_found"),
        (InvalidRequestError("bad", param="n"), 400, None),
        (EngineDeadError("gone"), 503, None),
        (RuntimeError("internal"), 500, None),
    ],
)
def test_the_code_is_openais_string_or_null(exc, status, code):
    got_status, body = exception_body(exc)
    assert (got_status, body.error.code) == (status, code)


def test_a_full_server_is_rate_limit_exceeded_and_a_bad_route_has_no_code():
    assert error_body("busy", 429).error.code == "rate_limit_exceeded"
    assert error_body("Not Found", 404).error.code is None
