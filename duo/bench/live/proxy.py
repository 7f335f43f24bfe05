"""A logging reverse proxy on 127.0.0.1 between a coding agent and duo-target: it records every exchange and may
rewrite a model call's body on its way (to force the first tool call, to clamp the answer's length)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from duo.net.listening import free_port

# Headers that describe one hop's framing, not the message: httpx and uvicorn set their own.
HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})
# Not passed on either: answers come back uncompressed, so that the record of each is readable.
NOT_FORWARDED = HOP_HEADERS | {"accept-encoding"}
# The status recorded for a request whose client left before its answer began (nginx's "client closed request").
CLIENT_LEFT = 499
# An event of a stream that carries generated text or call arguments, in any of the protocols: the Responses API's
# *.delta events, the Messages API's content_block_delta, a chat chunk's non-empty content, reasoning or arguments.
TOKEN_EVENT = re.compile(rb'\.delta\b|content_block_delta|"(content|reasoning_content|arguments)": ?"[^"]')


@dataclass
class Exchange:
    """One request the client sent and the answer it got, as they crossed the proxy."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    sent: bytes  # the body exactly as the client sent it
    forwarded: bytes  # the body as duo-target received it (after any rewrite)
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    answer: bytes = b""  # the whole response body, an SSE stream included
    done: bool = False
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0  # from the request's arrival to the answer's end
    first_token: float | None = None  # from the request's arrival to the first piece of a stream that carries a token

    def sent_json(self) -> dict | None:
        return json_object(self.sent)

    def is_stream(self) -> bool:
        return self.response_headers.get("content-type", "").startswith("text/event-stream")

    def summary(self) -> str:
        return (f"{self.method} {self.path}{'?' + self.query if self.query else ''} -> {self.status}"
                f" in {self.seconds:.1f}s")


async def client_left(request: Request) -> None:
    """Return once the client has closed its connection (its body was read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def json_object(raw: bytes) -> dict | None:
    """`raw` parsed, where it is a JSON object."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


# A rewrite takes the exchanges so far and the body the client sent, and returns the body to forward.
Rewrite = Callable[[list[Exchange], str, dict], dict]


class LoggingProxy:
    """Forwards everything to `upstream`, records each exchange in `exchanges`; `rewrite` edits JSON bodies."""

    def __init__(self, upstream: str, rewrite: Rewrite | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.rewrite = rewrite
        self.exchanges: list[Exchange] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[Route("/{path:path}", self.forward,
                                      methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])])
        # One event loop in one thread; no access log (the exchanges are the log).
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False,
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="agent-proxy", daemon=True)
        # Agents wait minutes for nothing else: no read timeout, as a client of a slow server would set.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10))

    def __enter__(self) -> LoggingProxy:
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return self
            time.sleep(0.02)
        raise RuntimeError("the logging proxy did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    async def forward(self, request: Request) -> Response:
        sent = await request.body()
        forwarded = self.rewritten(request.url.path, sent)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED}
        exchange = Exchange(request.method, request.url.path, request.url.query, dict(request.headers), sent,
                            forwarded)
        self.exchanges.append(exchange)
        url = f"{self.upstream}{request.url.path}{'?' + request.url.query if request.url.query else ''}"
        upstream = await self.unless_client_leaves(request, self.client.send(
            self.client.build_request(request.method, url, headers=headers, content=forwarded), stream=True))
        if upstream is None:
            exchange.status, exchange.seconds, exchange.done = CLIENT_LEFT, time.monotonic() - exchange.started, True
            return Response(status_code=CLIENT_LEFT)
        exchange.status = upstream.status_code
        exchange.response_headers = {k.lower(): v for k, v in upstream.headers.items()}
        answer_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(self.relay(upstream, exchange), status_code=upstream.status_code,
                                 headers=answer_headers)

    @staticmethod
    async def unless_client_leaves(request: Request, sending: Awaitable[httpx.Response]) -> httpx.Response | None:
        """The upstream's answer, or None where the client left first, the upstream request then cancelled (its
        connection closed, which duo-target reads as the client leaving).

        An answer that is not streamed starts only when it is whole: until then nothing but this watch sees a client
        give up (Claude Code abandons a request after its stream watchdog's 5 minutes and retries it), and duo-target
        would keep reading a prompt nobody waits for, in a place the retry then queues behind."""
        answer = asyncio.ensure_future(sending)
        leaving = asyncio.ensure_future(client_left(request))
        await asyncio.wait({answer, leaving}, return_when=asyncio.FIRST_COMPLETED)
        leaving.cancel()
        if answer.done():
            return answer.result()
        answer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await answer
        return None

    def rewritten(self, path: str, sent: bytes) -> bytes:
        body = json_object(sent) if self.rewrite else None
        return sent if body is None else json.dumps(self.rewrite(self.exchanges, path, body)).encode()

    @staticmethod
    async def relay(upstream: httpx.Response, exchange: Exchange) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                if exchange.first_token is None and TOKEN_EVENT.search(chunk):
                    exchange.first_token = time.monotonic() - exchange.started
                exchange.answer += chunk
                yield chunk
        finally:
            await upstream.aclose()
            exchange.seconds = time.monotonic() - exchange.started
            exchange.done = True

