"""What every HTTP request passes before the routes: CORS as llama-server answers it (preflights without the key, the
Origin echoed) with guards of its own, the API key, and the body's size and arrival time."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

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
# llama-server's --cors-origins keyword: any origin on this machine (http or https, any port), none other.
LOCALHOST = "localhost"
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


class Cors:
    """CORS as llama-server answers it: a request's Origin is echoed (with credentials allowed), a preflight (OPTIONS
    with Access-Control-Request-Method) is answered at once (200), without the key, allowing llama-server's methods
    and headers ("*"). `origins` narrows this to a list ("*": any; "localhost", llama-server's keyword: any origin on
    this machine, e.g. http://127.0.0.1:3000): a preflight from an Origin off the list gets no CORS headers, as
    llama-server answers it; any other request from there is refused (403) before it runs (a guard of duo's own: a
    form's text/plain POST needs no preflight, and would run unseen), but for the server's own pages (an Origin that
    is the server's own: same-origin). Requests without an Origin (no browser's, or a same-origin GET) pass as they
    are. The header names are written as llama-server writes them (Access-Control-Allow-Origin): a client that reads
    them from a plain dict finds them.

    A preflight from an origin the list names allows the headers it asks for rather than "*": a browser never lets
    "*" cover Authorization, which a page calling a server that has a key sends (from any other origin, a page
    sends the key as X-Api-Key, which "*" covers, as with llama-server).

    Private network access (Chrome's Access-Control-Allow-Private-Network, which lets a public page call a server on
    a LAN or localhost) is allowed only where a guard stands: the Origin is named on the list, or `keyed` (the API
    key is set, which such a page must then hold). Without either, any public page could drive a server on the
    user's own machine and read its answers (llama-server sends the header to no page)."""

    def __init__(self, app: ASGIApp, origins: Sequence[str] | None = None, keyed: bool = False) -> None:
        self.app = app
        named = None if origins is None or "*" in origins else frozenset(origin.rstrip("/") for origin in origins)
        self.loopback = named is not None and LOCALHOST in named  # a keyword, no origin a browser sends
        self.origins = named - {LOCALHOST} if named is not None else None
        self.keyed = keyed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is None:
            return await self.app(scope, receive, send)
        listed = self._listed(origin.decode("latin-1"))
        allowed = self.origins is None or listed or _same_origin(scope, headers, origin)
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            return await _preflight(headers, origin if allowed else None, listed=listed,
                                    private_network=listed or self.keyed, send=send)
        if not allowed:
            return await error_response(scope["path"], _refused(origin))(scope, receive, send)

        async def with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_allow(origin)]}
            await send(message)

        await self.app(scope, receive, with_cors)

    def _listed(self, origin: str) -> bool:
        """Whether the list names `origin`, or holds "localhost" and `origin` is on this machine."""
        if self.origins is None:
            return False
        return origin in self.origins or (self.loopback and is_loopback_origin(origin))


def is_loopback_origin(origin: str) -> bool:
    """Whether `origin` is http(s) on localhost, 127.0.0.1 or [::1], any port, as llama-server's "localhost" reads it:
    http://localhost.evil.com is not (its host is another name), nor is anything that is no URL."""
    try:
        parts = urlsplit(origin)
        host = parts.hostname
    except ValueError:  # a malformed authority, e.g. an unclosed [
        return False
    return parts.scheme in ("http", "https") and host in LOOPBACK_HOSTS


def _same_origin(scope: Scope, headers: dict[bytes, bytes], origin: bytes) -> bool:
    """Whether `origin` is the server's own, as the browser reached it (its scheme and the Host it sent): the chat
    page at / posts to the API from there. Behind a proxy that rewrites Host, the page's origin needs the list."""
    host = headers.get(b"host", b"")
    return bool(host) and origin.lower() == f"{scope.get('scheme', 'http')}://".encode() + host.lower()


def _refused(origin: bytes) -> ApiError:
    shown = origin.decode("latin-1")[:200]
    return ApiError(403, f"the origin {shown} is not in duo-target's --cors-origin list: start it with "
                         f"--cors-origin {shown} to let pages from there call it", code="origin_not_allowed")


async def _preflight(headers: dict[bytes, bytes], origin: bytes | None, *, listed: bool, private_network: bool,
                     send: Send) -> None:
    """A preflight's answer, 200 as llama-server's; for an origin off the list (None) without CORS headers, which
    the browser reads as a refusal (nothing runs on a preflight: the guard stands on the request that follows).
    The headers allowed: llama-server's "*", or for an origin the list names those the preflight asks for
    (Authorization among them, which "*" never covers)."""
    answer: list[tuple[bytes, bytes]] = []
    if origin is not None:
        asked = headers.get(b"access-control-request-headers", b"*") if listed else b"*"
        answer = [*_allow(origin), (b"Access-Control-Allow-Methods", ALLOWED_METHODS),
                  (b"Access-Control-Allow-Headers", asked),
                  (b"Access-Control-Max-Age", str(PREFLIGHT_MAX_AGE_S).encode())]
        if private_network and headers.get(b"access-control-request-private-network") == b"true":
            answer.append((b"Access-Control-Allow-Private-Network", b"true"))
    await send({"type": "http.response.start", "status": 200, "headers": [*answer, (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


def _allow(origin: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"Access-Control-Allow-Origin", origin), (b"Access-Control-Allow-Credentials", b"true"),
            (b"Vary", b"Origin")]


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
