"""Dialing a peer again after it went away: jittered backoff, slow retries after a refusal, one report while it
cannot be reached."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Awaitable, Callable

log = logging.getLogger("duo.net")

# A peer that went away (a draft, or a target a draft joins) is dialed again after a jittered backoff that doubles
# from RECONNECT_FIRST_S to RECONNECT_MAX_S, and quickly again after a connection that lasted.
RECONNECT_FIRST_S = 0.2
RECONNECT_MAX_S = 2.0


# While a peer cannot be reached, its dialer says so at the first failure, then this often.
UNREACHABLE_LOG_EVERY_S = 60.0


class Unreachable:
    """When a peer that cannot be reached is worth a log line: at its first failure since it was last up, then every
    UNREACHABLE_LOG_EVERY_S while it lasts (a peer on loopback, or behind a firewall, fails every few seconds)."""

    def __init__(self) -> None:
        self.since: float | None = None  # the first failure since the peer was last up
        self.logged_at = 0.0

    def reached(self) -> None:
        self.since = None

    def seconds_to_log(self) -> float | None:
        """A failure now: how long the peer has been unreachable, when a line is due; None when it is not."""
        now = asyncio.get_running_loop().time()
        if self.since is None:
            self.since = now
        elif now - self.logged_at < UNREACHABLE_LOG_EVERY_S:
            return None
        self.logged_at = now
        return now - self.since


async def keep_reconnecting(connect_once: Callable[[], Awaitable[None]], on_bug: Callable[[Exception], None],
                            refused: Callable[[], bool], refused_retry_s: float,
                            running: Callable[[], bool] = lambda: True) -> None:
    """Run `connect_once` again and again while `running()`, backing off between tries; while `refused()` (the peer
    refused this pair: it may be restarted with the right model) every `refused_retry_s`. An exception from it is a
    bug, which must cost the connection, never the process: `on_bug` says so, and the loop goes on."""
    backoff = RECONNECT_FIRST_S
    while running():
        started = asyncio.get_running_loop().time()
        try:
            await connect_once()
        except Exception as error:
            on_bug(error)
        if asyncio.get_running_loop().time() - started > 10 * RECONNECT_MAX_S:
            backoff = RECONNECT_FIRST_S  # it was up for a while: retry quickly
        await asyncio.sleep(refused_retry_s if refused() else backoff * (0.5 + random.random()))
        backoff = min(RECONNECT_MAX_S, backoff * 2)
