"""Answers that outlive their handler: server-sent event streams that always close their completion, and work
cancelled when the client leaves."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from duo.api.serving.choices import Choices
from duo.net.timeouts import WriteTimeout, write_within

log = logging.getLogger("duo.http")

T = TypeVar("T")

# nginx's "client closed request": logged for requests whose client left before the answer.
CLIENT_CLOSED = 499


class EventStream(StreamingResponse):
    """Server-sent events that close their completion whatever happens to the connection, which frees
    the request's running place and its sessions on the target and the draft. A client that takes no
    event for `write_timeout` seconds (its socket buffers stayed full) is dropped."""

    def __init__(self, events: AsyncIterator[str], completion: Choices, *, write_timeout: float,
                 on_timeout: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events = events
        self.completion = completion
        self.write_timeout = write_timeout
        self.on_timeout = on_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_within_timeout(message: Message) -> None:
            await write_within(send(message), self.write_timeout)

        try:
            await super().__call__(scope, receive, send_within_timeout)
        except WriteTimeout as error:
            # ASGI cannot abort a response; returning before its end makes uvicorn close the connection.
            host, port = scope.get("client") or ("?", 0)
            log.warning("dropped client %s:%s: %s", host, port, error)
            self.on_timeout()
        finally:
            # The events first: a stream left suspended (a write timeout, a client gone mid-send) still iterates
            # its completion, which cannot be closed while it does.
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
            await self.completion.aclose()


async def until_disconnected(request: Request) -> None:
    """Return once the client has closed the connection (its body was read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left, or this handler was cancelled (the server stops): so does the work
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone()
    return task.result()


