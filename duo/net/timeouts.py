"""Waiting on a peer with a bound: an awaitable within its seconds, a write a client must take in time."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")

# A streaming client that takes nothing for this long is dropped (duo-target --write-timeout): else one
# that stops reading holds its running place, its context and its draft session forever.
WRITE_TIMEOUT_S = 30.0


async def within(awaitable: Awaitable[T], seconds: float) -> T:
    """`awaitable`'s result, or asyncio.TimeoutError after `seconds` (the awaitable is then cancelled).

    asyncio.wait_for up to Python 3.11 swallows a cancellation of the waiting task when the awaitable completes
    in the same turn of the loop (CPython gh-86296): the task goes on as if never cancelled. The link's writer
    did exactly that, and a DraftLink being cancelled then waited forever for it. asyncio.wait never swallows it.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    finally:
        if not task.done():  # timed out, or this task was cancelled: the awaitable goes too
            task.cancel()
        # Where this task is cancelled, the awaitable may still end with an error of its own (a call's stream ending
        # as it is cancelled) that nobody reads below: read it, so that asyncio does not log it as never retrieved.
        task.add_done_callback(lambda ended: ended.cancelled() or ended.exception())
    if not done:
        await asyncio.wait({task})  # cancelled for good before saying so
        raise asyncio.TimeoutError(f"not done within {seconds:g} s")
    return task.result()


class WriteTimeout(Exception):
    """The peer took none of a message for the write timeout: it stopped reading."""


async def write_within(write: Awaitable[None], timeout: float) -> None:
    """Await `write` (a send that waits while the peer's buffers are full), or raise WriteTimeout."""
    try:
        await within(write, timeout)
    except asyncio.TimeoutError:
        raise WriteTimeout(f"the client read nothing for {timeout:g} s (duo-target --write-timeout)") from None
