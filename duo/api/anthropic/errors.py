"""Errors in Anthropic's shape for the Messages API's paths: {"type": "error", "error": {"type", "message"}}, with
the HTTP status duo gives the same error on its other routes."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from duo.api.serving.generate import failure_message

# Anthropic's error types by HTTP status; any other 4xx is an invalid request, any other 5xx an api_error.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}
PATH_PREFIX = "/v1/messages"


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def reshaped(body: bytes, status: int) -> bytes | None:
    """An error body of OpenAI's shape ({"error": {"message", ...}}) in Anthropic's; None for any other body."""
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    error = answer.get("error") if isinstance(answer, dict) and answer.get("type") != "error" else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None
    return json.dumps(error_body(status, error["message"]), ensure_ascii=False).encode()


class AnthropicErrors:
    """Reshapes the error answers on PATH_PREFIX, whatever raised them: duo's handlers answer errors in OpenAI's
    shape, and the Anthropic SDK (and Claude Code) read Anthropic's. Only JSON answers of status 400 and above are
    held and rewritten; streams and answers pass as they are. A failure that escapes the app's handlers (they answer
    it outside this middleware) is answered here, as a 500."""

    def __init__(self, app: ASGIApp, prefix: str = PATH_PREFIX) -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            return await self.app(scope, receive, send)
        held: Message | None = None  # an error answer's start, sent once its body is reshaped
        body = b""
        started = False

        async def reshaping(message: Message) -> None:
            nonlocal held, body, started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400 and _is_json(message):
                    held = message
                    return
            elif held is not None and message["type"] == "http.response.body":
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    await _send(send, held, reshaped(body, held["status"]) or body)
                return
            await send(message)

        try:
            await self.app(scope, receive, reshaping)
        except Exception as error:  # Starlette answers these outside this middleware: answered here instead
            if started:
                raise
            answer = json.dumps(error_body(500, failure_message(error)), ensure_ascii=False).encode()
            await _send(send, {"type": "http.response.start", "status": 500,
                               "headers": [(b"content-type", b"application/json")]}, answer)


def _is_json(start: Message) -> bool:
    return any(name.lower() == b"content-type" and value.startswith(b"application/json")
               for name, value in start.get("headers", []))


async def _send(send: Send, start: Message, body: bytes) -> None:
    headers = [(name, value) for name, value in start.get("headers", []) if name.lower() != b"content-length"]
    await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
