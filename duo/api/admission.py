"""Admission: at most N generations run at once, up to M more wait their turn in arrival order, the rest are refused."""

from __future__ import annotations

import asyncio
from collections import deque


class QueueFull(Exception):
    """Every running place and every waiting place is taken; the client should retry later."""


class Slot:
    """A running place, held from admission until release (releasing twice is harmless)."""

    def __init__(self, admission: "Admission") -> None:
        self._admission = admission
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._release()


class Admission:
    """A fair (FIFO) bounded queue in front of the target.

    A released place goes straight to the longest-waiting request, so a newcomer never overtakes a
    request that is already waiting.
    """

    def __init__(self, parallel: int, queue_size: int) -> None:
        if parallel < 1 or queue_size < 0:
            raise ValueError("--parallel must be >= 1 and --queue-size >= 0")
        self.parallel = parallel
        self.queue_size = queue_size
        self.running = 0
        self._waiting: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self) -> Slot:
        """Wait for a running place; raise QueueFull at once when the waiting line is full too."""
        if self.running < self.parallel and not self._waiting:
            self.running += 1
            return Slot(self)
        if len(self._waiting) >= self.queue_size:
            raise QueueFull(f"the server is busy: {self.running} requests running and {len(self._waiting)} "
                            "waiting (the most it queues); retry later")
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn in self._waiting:
                self._waiting.remove(turn)
            elif turn.done() and not turn.cancelled():
                self._release()  # the place was handed over just as the caller gave up: pass it on
            raise
        return Slot(self)

    def _release(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the place changes hands; `running` stays the same
                return
        self.running -= 1
