"""What every HTTP request passes before the routes: CORS as llama-server answers it (preflights without the key, the
Origin echoed) with guards of its own, the API key, and the body's size and arrival time."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Sequence

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from duo.api.http.errors import error_response
from duo.api.openai.errors import ApiError
from duo.api.page import PAGE_PATHS
from duo.net.timeouts import within

# A request body must arrive within this long (a client trickling bytes would hold a connection forever).
BODY_READ_TIMEOUT_S = 30.0
# What anyone may read without the key, as llama-server leaves /health and the model list public (a browser page or
# an editor finds the server and its model before it is given a key); /metrics for scrapers, /openapi.json for docs.
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/metrics", "/openapi.json", "/models", "/v1/models"})
# How long a browser may keep a preflight's answer.
PREFLIGHT_MAX_AGE_S = 600
# The methods a preflight allows: llama-server's (DELETE too, which its own routes take).
ALLOWED_METHODS = b"GET, POST, DELETE, OPTIONS"


class Cors:
    """CORS as llama-server answers it: a request's Origin is echoed (with credentials allowed), a preflight (OPTIONS
    with Access-Control-Request-Method) is answered at once (200), without the key, allowing llama-server's methods
    and the headers it asks for. `origins` narrows this to a list ("*": any): a preflight from an Origin off the list
    gets no CORS headers, as llama-server answers it; any other request from there is refused (403) before it runs
    (a guard of duo's own: a form's text/plain POST needs no preflight, and would run unseen), but for
    the server's own pages (an Origin that is the server's own: same-origin). Requests without an Origin (no
    browser's, or a same-origin GET) pass as they are.

    Private network access (Chrome's Access-Control-Allow-Private-Network, which lets a public page call a server on
    a LAN or localhost) is allowed only where a guard stands: the Origin is named on the list, or `keyed` (the API
    key is set, which such a page must then hold). Without either, any public page could drive a server on the
    user's own machine and read its answers (llama-server sends the header to no page)."""

    def __init__(self, app: ASGIApp, origins: Sequence[str] | None = None, keyed: bool = False) -> None:
        self.app = app
        self.origins = None if origins is None or "*" in origins else frozenset(origin.rstrip("/") for origin in origins)
        self.keyed = keyed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is None:
            return await self.app(scope, receive, send)
        listed = self.origins is not None and origin.decode("latin-1") in self.origins
        allowed = self.origins is None or listed or _same_origin(scope, headers, origin)
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            return await _preflight(headers, origin if allowed else None, private_network=listed or self.keyed,
                                    send=send)
        if not allowed:
            return await error_response(scope["path"], _refused(origin))(scope, receive, send)

        async def with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_allow(origin)]}
            await send(message)

        await self.app(scope, receive, with_cors)


def _same_origin(scope: Scope, headers: dict[bytes, bytes], origin: bytes) -> bool:
    """Whether `origin` is the server's own, as the browser reached it (its scheme and the Host it sent): the chat
    page at / posts to the API from there. Behind a proxy that rewrites Host, the page's origin needs the list."""
    host = headers.get(b"host", b"")
    return bool(host) and origin.lower() == f"{scope.get('scheme', 'http')}://".encode() + host.lower()


def _refused(origin: bytes) -> ApiError:
    shown = origin.decode("latin-1")[:200]
    return ApiError(403, f"the origin {shown} is not in duo-target's --cors-origin list: start it with "
                         f"--cors-origin {shown} to let pages from there call it", code="origin_not_allowed")


async def _preflight(headers: dict[bytes, bytes], origin: bytes | None, *, private_network: bool,
                     send: Send) -> None:
    """A preflight's answer, 200 as llama-server's; for an origin off the list (None) without CORS headers, which
    the browser reads as a refusal (nothing runs on a preflight: the guard stands on the request that follows).
    The headers allowed are those the preflight asks for, not llama-server's "*": a browser never lets "*" cover
    Authorization, which a page calling a server that has a key must send."""
    answer: list[tuple[bytes, bytes]] = []
    if origin is not None:
        answer = [*_allow(origin), (b"access-control-allow-methods", ALLOWED_METHODS),
                  (b"access-control-allow-headers", headers.get(b"access-control-request-headers", b"*")),
                  (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode())]
        if private_network and headers.get(b"access-control-request-private-network") == b"true":
            answer.append((b"access-control-allow-private-network", b"true"))
    await send({"type": "http.response.start", "status": 200, "headers": [*answer, (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


def _allow(origin: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin), (b"access-control-allow-credentials", b"true"),
            (b"vary", b"Origin")]


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
            return await error_response(scope["path"], _wrong_key())(scope, receive, send)
        length, max_bytes = headers.get(b"content-length", b"0"), self.limit()
        if length.isdigit() and int(length) > max_bytes:
            return await error_response(scope["path"], self._too_large(max_bytes))(scope, receive, send)
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
