"""Errors the HTTP API returns, in OpenAI's error-object shape.

Every 4xx/5xx the server sends is an ``APIError`` rendered by ``.body()``::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Types and codes follow OpenAI where it has a name for the case (an unknown model is a 404 with type
``invalid_request_error`` and code ``model_not_found``; a too-long request is ``context_length_exceeded``),
so clients that branch on them (agents that compact their history on ``context_length_exceeded``) work.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from pydantic import ValidationError

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
SERVER_ERROR = "server_error"
SERVICE_UNAVAILABLE = "service_unavailable"


class APIError(Exception):
    """An error answer: HTTP ``status``, OpenAI ``type``/``param``/``code``, extra response ``headers``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        """The OpenAI error object, ready for JSON encoding."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def bad_request(message: str, param: str | None = None) -> APIError:
    """400 invalid_request_error; ``param`` names the offending field (dotted path) when there is one."""
    return APIError(400, message, INVALID_REQUEST, param=param)


def not_found_model(name: str, available: Iterable[str]) -> APIError:
    """404 for a model this server does not serve, listing the ones it does."""
    names = ", ".join(sorted(available)) or "(none)"
    message = f"The model '{name}' does not exist on this server; available models: {names}"
    return APIError(404, message, INVALID_REQUEST, param="model", code="model_not_found")


def unauthorized() -> APIError:
    """401 for a missing or wrong API key (the key itself is never echoed back)."""
    message = "Missing or invalid API key; send it as 'Authorization: Bearer <key>'"
    return APIError(401, message, AUTHENTICATION, code="invalid_api_key")


def too_large(limit_mib: int | float) -> APIError:
    """413 for a request body over the server's size limit."""
    message = f"Request body exceeds the limit of {limit_mib} MiB"
    return APIError(413, message, INVALID_REQUEST, code="request_too_large")


def overloaded(retry_after_s: float, reason: str | None = None) -> APIError:
    """503 with a Retry-After header (whole seconds, at least 1) when the server cannot take the request
    now; ``reason`` (e.g. "queue full", "shutting down") is added to the message. The code is OpenAI's
    server_is_overloaded, the one Codex retries as overload."""
    seconds = max(1, math.ceil(retry_after_s))
    message = f"The server cannot take this request now ({reason or 'overloaded'}); retry after {seconds} s"
    return APIError(
        503, message, SERVICE_UNAVAILABLE, code="server_is_overloaded", headers={"Retry-After": str(seconds)}
    )


def internal_error(message: str) -> APIError:
    """500 for a failure that is the server's fault, not the request's."""
    return APIError(500, message, SERVER_ERROR)


def context_overflow(prompt_tokens: int, max_tokens: int, ctx_size: int) -> APIError:
    """400 context_length_exceeded: prompt + max_tokens does not fit in the context.

    The wording starts like OpenAI's ("This model's maximum context length is ...") because some clients
    match on it, and ends with the server flag that raises the limit.
    """
    total = prompt_tokens + max_tokens
    message = (
        f"This model's maximum context length is {ctx_size} tokens. However, you requested {total} tokens "
        f"({prompt_tokens} in the prompt, {max_tokens} for max_tokens). Please reduce the length of the "
        f"prompt or max_tokens, or restart the server with a larger --ctx-size."
    )
    return APIError(400, message, INVALID_REQUEST, param="max_tokens", code="context_length_exceeded")


# Pydantic tags the members of a union in the error location ("stop", "list[str]"); they are not fields.
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_union_tag(part: str | int) -> bool:
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part)


def _dotted(loc: tuple) -> str:
    return ".".join(str(part) for part in loc if not _is_union_tag(part))


def _error_text(error: dict) -> str:
    # Our own validators raise ValueError; pydantic would prefix its text with "Value error, ".
    if error["type"] in ("value_error", "assertion_error") and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    return error["msg"]


def from_validation_error(exc: ValidationError) -> APIError:
    """400 listing every bad field as ``path: message``; ``param`` is the first bad field's dotted path."""
    lines: list[str] = []
    paths: list[str] = []
    for error in exc.errors(include_url=False):
        path = _dotted(tuple(error["loc"]))
        line = f"{path}: {_error_text(error)}" if path else _error_text(error)
        if line not in lines:
            lines.append(line)
            paths.append(path)
    param = paths[0] if paths and paths[0] else None
    return bad_request("; ".join(lines) or "invalid request", param=param)
