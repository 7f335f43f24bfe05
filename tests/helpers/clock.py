"""A clock a test moves by hand, and the rests a switch takes."""

from __future__ import annotations


class Clock:
    """Seconds as the test sets them (`now`), for code that takes a clock: the switch, the pool."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def rests_of(regimes: list[bool]) -> list[int]:
    """The lengths of the stretches off, in order."""
    rests, length = [], 0
    for speculating in regimes:
        if not speculating:
            length += 1
        elif length:
            rests, length = rests + [length], 0
    return rests
