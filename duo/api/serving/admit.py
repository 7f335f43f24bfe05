"""Admission: at most N generations run at once, up to M more wait their turn in arrival order, the rest are refused."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from types import TracebackType


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


class Places:
    """The places one request took (one per choice), guarding them until they are handed over.

    Used as `with places:` around everything between taking them and handing them to the request's completions:
    whatever fails in between (a bad field, a grammar that does not compile, a bug) gives them back on the way out,
    so no call site needs a `try` of its own and none can forget one. Once handed over (hand_over) the completions
    own them; once tied to work that outlives the request (release_after: a tokenizing thread that cannot be
    stopped), they are given back when that work ends.
    """

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self._owned = False  # by the completions, or by work that outlives the request

    def __enter__(self) -> "Places":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if error is not None and not self._owned:
            self.release()

    def hand_over(self) -> list[Slot]:
        self._owned = True
        return self.slots

    def release_after(self, work: asyncio.Future) -> None:
        """Give the places back once `work` has stopped (its error, if any, is nobody's to report)."""
        self._owned = True

        def done(finished: asyncio.Future) -> None:
            self.release()
            if not finished.cancelled():
                finished.exception()

        work.add_done_callback(done)

    def release(self) -> None:
        for slot in self.slots:
            slot.release()


@dataclass(eq=False)
class _Turn:
    """A request waiting for `need` places, `got` of which it holds already (handed over as others left)."""

    future: asyncio.Future[None]
    need: int
    got: int = 0


class Admission:
    """A fair (FIFO) bounded queue in front of the target.

    A released place goes straight to the longest-waiting request, so a newcomer never overtakes a
    request that is already waiting. A request of several choices takes its places together: it waits
    in the same line, and holds none it cannot use (two such requests taking theirs one at a time could
    each hold some and wait for the other's forever).
    """

    def __init__(self, parallel: int, queue_size: int) -> None:
        if parallel < 1 or queue_size < 0:
            raise ValueError("--parallel must be >= 1 and --queue-size >= 0")
        self.parallel = parallel
        self.queue_size = queue_size
        self.running = 0  # places held, also those a waiting request of several choices holds already
        self._waiting: deque[_Turn] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self) -> Slot:
        """Wait for a running place; raise QueueFull at once when the waiting line is full too."""
        return (await self.acquire_places(1)).slots[0]

    async def acquire_places(self, n: int) -> Places:
        """Wait for `n` running places at once (n <= parallel); QueueFull at once when the waiting line is full."""
        if not 1 <= n <= self.parallel:
            raise ValueError(f"a request takes between 1 and {self.parallel} places, not {n}")
        if self.running + n <= self.parallel and not self._waiting:
            self.running += n
            return Places([Slot(self) for _ in range(n)])
        if len(self._waiting) >= self.queue_size:
            raise QueueFull(f"the server is busy: {self.running} requests running and {len(self._waiting)} "
                            "waiting (the most it queues); retry later")
        turn = _Turn(asyncio.get_running_loop().create_future(), n)
        if not self._waiting:  # first in line: it takes the free places now, the rest as others leave
            turn.got = self.parallel - self.running
            self.running += turn.got
        self._waiting.append(turn)
        try:
            await turn.future
        except asyncio.CancelledError:
            if turn in self._waiting:
                self._waiting.remove(turn)
            for _ in range(turn.got):  # the places it held, or was handed just as it gave up: passed on
                self._release()
            raise
        return Places([Slot(self) for _ in range(n)])

    def _release(self) -> None:
        if self._waiting:
            turn = self._waiting[0]
            turn.got += 1  # the place changes hands; `running` stays the same
            if turn.got == turn.need:
                self._waiting.popleft()
                if not turn.future.done():  # cancelled, its handler not run yet: it passes the places on
                    turn.future.set_result(None)
            return
        self.running -= 1
