"""ATOM's exceptions, and the one place they map to HTTP status codes."""

from __future__ import annotations


class AtomError(Exception):
    """Base of every error ATOM raises on purpose."""


class ConfigError(AtomError, ValueError):
    """A flag or config value is invalid or not supported; raised before any work starts."""


class UnsupportedError(AtomError):
    """Something was asked for that no installed plugin provides."""


class PluginConflictError(AtomError):
    """Two plugins claim the same name, or a plugin registered something malformed."""


class InvalidRequestError(AtomError, ValueError):
    """A request is malformed; ``param`` names the offending field when there is one, and
    ``code`` is the error's machine-readable code in OpenAI's body (e.g.
    ``context_length_exceeded``) when it has one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ModelNotFoundError(AtomError):
    """A request names a model this server does not serve."""


class AuthenticationError(AtomError):
    """A missing or wrong API key."""


class EngineDeadError(AtomError):
    """The engine process is gone; requests cannot be served."""


class RequestTooLargeError(AtomError):
    """A request body over --max-request-body-bytes."""


class QueueFullError(AtomError):
    """--max-queued-requests generation requests are already waiting for their first token."""


class RequestTimeoutError(AtomError):
    """A generation request ran past --request-timeout; its generation was aborted."""


HTTP_STATUS: dict[type[AtomError], int] = {
    InvalidRequestError: 400,
    ConfigError: 400,
    AuthenticationError: 401,
    ModelNotFoundError: 404,
    RequestTooLargeError: 413,
    QueueFullError: 429,
    EngineDeadError: 503,
    RequestTimeoutError: 504,
}


def http_status(exc: BaseException) -> int:
    """The HTTP status for ``exc``: the entry of its nearest class in HTTP_STATUS, else 500."""
    for cls in type(exc).__mro__:
        if cls in HTTP_STATUS:
            return HTTP_STATUS[cls]
    return 500
