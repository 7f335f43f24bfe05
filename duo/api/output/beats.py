"""A stream's heartbeat: the pieces of an answer as they come, and a beat each time a while passes without one, so
that a protocol can tell its client it is alive while the prompt is read (an agent's prompt of 10-20k tokens on one
core takes minutes, past the clients' idle timeouts: Claude Code's and Codex's are 5 minutes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import aclosing
from typing import TypeVar

from duo.api.serving.generate import Piece

T = TypeVar("T")


async def beating(pieces: AsyncIterable[Piece], interval: float) -> AsyncIterator[Piece | None]:
    """`pieces` as they come, and None each time `interval` seconds pass without one (while the prompt is read).
    The next piece is awaited in a task of its own, so that waiting for it can time out without cancelling it; on
    leaving, that task is cancelled and awaited, so that the pieces can be closed after."""
    iterator = aiter(pieces)
    waiting: asyncio.Future[Piece] | None = None
    try:
        while True:
            if waiting is None:
                waiting = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({waiting}, timeout=interval)
            if not done:
                yield None
                continue
            try:
                piece = waiting.result()
            except StopAsyncIteration:
                return
            waiting = None
            yield piece
    finally:
        if waiting is not None:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)


async def kept_alive(pieces: AsyncIterable[Piece], interval: float, events_of: Callable[[Piece], list[T]],
                     beat: Callable[[], T]) -> AsyncIterator[T]:
    """Each piece's events (`events_of`) as they come, and `beat()` each time `interval` seconds passed with none sent:
    while the prompt is read, and while a piece makes no event (a call held until whole)."""
    said = time.monotonic()  # when the last event was sent
    async with aclosing(beating(pieces, interval)) as beats:
        async for piece in beats:
            events = [] if piece is None else events_of(piece)
            if not events and time.monotonic() - said >= interval:
                events = [beat()]
            for event in events:
                yield event
            if events:
                said = time.monotonic()
