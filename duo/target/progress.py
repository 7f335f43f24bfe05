"""How far the target has read a request's prompt (llama-server's prompt_progress), told after each read call."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ReadProgress:
    """A prompt's read so far: `cache` tokens of its `total` were in the cache, `processed` are in its sequence now
    (the cache's and those read since), `seconds` since the read began; `read_seconds`: from the read's start to
    the end of its last read call (0 before the first: llama-server's prompt_ms)."""

    total: int
    cache: int
    processed: int
    seconds: float

    @property
    def read(self) -> int:
        """Tokens read so far (not the cache's)."""
        return self.processed - self.cache

    @property
    def read_seconds(self) -> float:
        return self.seconds if self.read else 0.0


class ReadClock:
    """A prompt's read, timed from the moment the cache's prefix is known: each read's ReadProgress."""

    def __init__(self, total: int, cache: int) -> None:
        self.total = total
        self.cache = cache
        self.started = time.monotonic()

    def at(self, processed: int) -> ReadProgress:
        """The progress once `processed` tokens of the prompt are in the sequence, told right after its read call."""
        return ReadProgress(self.total, self.cache, processed, time.monotonic() - self.started)
