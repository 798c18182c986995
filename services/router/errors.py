"""OpenAI-style errors: one exception type carrying the HTTP status and the error body fields, the encode
guard that turns a value the wire cannot carry into a 400 naming its field, and the ASGI safety net that
answers an unexpected exception with a JSON 500 without tearing down the keep-alive connection."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # as OpenAI answers a missing/incorrect key (code says which)
    403: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


# Anthropic's error types by status (/v1/messages answers in Anthropic's error shape)
_ANTHROPIC_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   405: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
                   499: "invalid_request_error", 503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_path(path: str) -> bool:
    """The routes that answer errors in Anthropic's shape (``/v1/messages``, ``/v1/messages/count_tokens``)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPE_BY_STATUS.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``; the message names the field."""
        msg = self.message if not self.param or self.param in self.message else f"{self.param}: {self.message}"
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPE.get(self.status, "api_error"), "message": msg}}

    def response(self, anthropic: bool = False) -> Response:
        # ASCII JSON: a message or param that quotes client text (a lone surrogate included) always encodes.
        body = self.anthropic_body() if anthropic else self.body()
        return Response(json.dumps(body).encode(), status_code=self.status, headers=self.headers, media_type="application/json")


def unencodable(e: BaseException) -> str:
    """Why a value could not be set on a protobuf field, in words a client can act on."""
    if isinstance(e, UnicodeError):
        return "text is not valid Unicode (a lone UTF-16 surrogate such as \\udc80?)"
    if "out of range" in str(e).lower() or isinstance(e, OverflowError):
        return "integer out of the supported range"
    return str(e)


@contextmanager
def wire_field(param: str) -> Iterator[None]:
    """Guard setting one request value on the wire message: a value that passed validation but that the
    protobuf field cannot carry (integer overflow, lone surrogate) raises ``APIError(400)`` naming ``param``."""
    try:
        yield
    except (ValueError, TypeError, OverflowError) as e:
        raise APIError(400, f"invalid value for '{param}': {unencodable(e)}", code="invalid_value", param=param) from None


class CatchAll:
    """Innermost-but-one ASGI net: an exception no handler took becomes a JSON 500 and is *not* re-raised,
    so the server keeps the keep-alive connection (Starlette's own 500 path re-raises and uvicorn then
    closes the socket). ``on_error(exc)`` counts/logs it. Mutates nothing else."""

    def __init__(self, app: ASGIApp, on_error: Callable[[Exception], None] | None = None) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:  # noqa: BLE001 - the net: nothing escapes to the server
            if self.on_error is not None:
                self.on_error(e)
            else:
                log.exception("unexpected router error")
            if started:
                return  # mid-response: nothing more can be said; the server ends the response
            await APIError(500, "internal router error; see router logs", code="internal_error").response()(scope, receive, send)
