"""What every HTTP request passes before the routes: CORS as llama-server answers it (preflights without the key, the
Origin echoed), the API key, and the body's size and arrival time."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable, Sequence

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from duo.api.answers import ApiError
from duo.api.page import PAGE_PATHS
from duo.runtime import within

# A request body must arrive within this long (a client trickling bytes would hold a connection forever).
BODY_READ_TIMEOUT_S = 30.0
# What anyone may read without the key, as llama-server leaves /health and the model list public (a browser page or
# an editor finds the server and its model before it is given a key); /metrics for scrapers, /openapi.json for docs.
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/metrics", "/openapi.json", "/models", "/v1/models"})
# How long a browser may keep a preflight's answer.
PREFLIGHT_MAX_AGE_S = 600


class Cors:
    """CORS as llama-server answers it: a request's Origin is echoed (with credentials allowed), a preflight (OPTIONS
    with Access-Control-Request-Method) is answered at once, without the key, allowing the method and headers it
    asks for. `origins` narrows this to a list ("*": any); an Origin off the list gets no CORS headers, and its
    preflight a 403."""

    def __init__(self, app: ASGIApp, origins: Sequence[str] | None = None) -> None:
        self.app = app
        self.origins = None if origins is None or "*" in origins else frozenset(origin.rstrip("/") for origin in origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is None:
            return await self.app(scope, receive, send)
        allowed = self.origins is None or origin.decode("latin-1") in self.origins
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            return await self._preflight(headers, origin, allowed, send)
        if not allowed:
            return await self.app(scope, receive, send)

        async def with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_allow(origin)]}
            await send(message)

        await self.app(scope, receive, with_cors)

    async def _preflight(self, headers: dict[bytes, bytes], origin: bytes, allowed: bool, send: Send) -> None:
        if not allowed:
            error = ApiError(403, f"the origin {origin.decode('latin-1')[:200]} is not in duo-target's --cors-origin "
                                  "list", code="origin_not_allowed")
            return await _send_json(send, error.status, json.dumps(error.body()).encode(), [])
        answer = [*_allow(origin), (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                  (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode())]
        if b"access-control-request-headers" in headers:
            answer.append((b"access-control-allow-headers", headers[b"access-control-request-headers"]))
        if headers.get(b"access-control-request-private-network") == b"true":  # a public page calling a LAN server
            answer.append((b"access-control-allow-private-network", b"true"))
        await _send_json(send, 204, b"", answer)


def _allow(origin: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin), (b"access-control-allow-credentials", b"true"),
            (b"vary", b"Origin")]


async def _send_json(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    content = [(b"content-type", b"application/json")] if body else []
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, *content, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Gate:
    """Before any body is read: refuses requests without the API key (401) but for PUBLIC_PATHS, the key sent as
    llama-server takes it (`Authorization: Bearer <key>`, a bare `Authorization: <key>`, or `X-Api-Key: <key>`);
    then refuses bodies over `max_bytes` (413) without reading them into memory, and bodies that take longer than
    `read_timeout` to arrive (408)."""

    def __init__(self, app: ASGIApp, max_bytes: Callable[[], int], api_key: str | None,
                 read_timeout: float = BODY_READ_TIMEOUT_S) -> None:
        self.app = app
        self.limit = max_bytes  # what the model's context can use: known once it is loaded
        self.key = api_key.encode() if api_key else None
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key and _needs_key(scope["path"]) and not self._key_matches(headers):
            return await _wrong_key().response()(scope, receive, send)
        length, max_bytes = headers.get(b"content-length", b"0"), self.limit()
        if length.isdigit() and int(length) > max_bytes:
            return await self._too_large(max_bytes).response()(scope, receive, send)
        received, complete = 0, False
        deadline = asyncio.get_running_loop().time() + self.read_timeout

        async def limited() -> Message:
            nonlocal received, complete
            if complete:  # later receives wait for the client to leave: no deadline
                return await receive()
            try:
                message = await within(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.read_timeout:g} s") from None
            received += len(message.get("body", b""))
            complete = not message.get("more_body", False)
            if received > max_bytes:
                raise HTTPException(413, str(self._too_large(max_bytes)))
            return message

        await self.app(scope, limited, send)

    def _key_matches(self, headers: dict[bytes, bytes]) -> bool:
        sent = headers.get(b"authorization") or headers.get(b"x-api-key") or b""
        sent = sent[len(b"Bearer "):] if sent[:7].lower() == b"bearer " else sent
        return hmac.compare_digest(sent.strip(), self.key or b"")

    def _too_large(self, max_bytes: int) -> ApiError:
        return ApiError(413, f"the request body is larger than {max_bytes} bytes, more than the model's context "
                             "can use")


def _needs_key(path: str) -> bool:
    """Everything but PUBLIC_PATHS, the chat page's files (public as llama-server's page: the page asks for the key
    and sends it with its API calls) and one model's card needs the key."""
    return path not in PUBLIC_PATHS and path not in PAGE_PATHS and not path.startswith("/v1/models/")


def _wrong_key() -> ApiError:
    return ApiError(401, "missing or wrong API key: send the header `Authorization: Bearer <key>` (or "
                         "`X-Api-Key: <key>`)", code="invalid_api_key", type="authentication_error")
