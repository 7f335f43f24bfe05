"""A target context's model calls recorded, and one prompt chunk held on the model thread, as a long chunk on a slow
core is while its client gives up (tests of prompts abandoned during their read)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from duo.llama.context import Context, Part

HOLD_S = 30  # a held call waits at most this long for the test to let it go


class HeldCalls:
    """The target context's model calls, recorded; the prompt chunk `hold()` names is held on the model thread until
    `release()`, as a long chunk of a slow core would be while its client gives up."""

    def __init__(self, context: Context) -> None:
        self.calls: list[list[Part]] = []
        self.reached, self.released = threading.Event(), threading.Event()
        self._skip: int | None = None
        decode_parts = context.decode_parts

        def recording(parts: Sequence[Part]):
            self.calls.append(list(parts))
            if self._skip is not None and any(not part.logits_for for part in parts):
                self._skip -= 1
                if self._skip < 0:
                    self._skip = None
                    self.reached.set()
                    self.released.wait(HOLD_S)
            return decode_parts(parts)

        context.decode_parts = recording

    def hold(self, after: int) -> None:
        """Hold the prompt chunk that comes after `after` more of them."""
        self._skip = after
        self.reached.clear()
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    def prompt_chunks(self) -> list[tuple[int, int]]:
        """(position, tokens) of every prompt chunk decoded so far (parts with no logits)."""
        return [(part.pos, len(part.tokens)) for call in self.calls for part in call if not part.logits_for]
