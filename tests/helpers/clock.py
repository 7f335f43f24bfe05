"""A clock a test moves by hand, and the rests a switch takes."""

from __future__ import annotations


def rests_of(regimes: list[bool]) -> list[int]:
    """The lengths of the stretches off, in order."""
    rests, length = [], 0
    for speculating in regimes:
        if not speculating:
            length += 1
        elif length:
            rests, length = rests + [length], 0
    return rests
