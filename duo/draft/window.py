"""The draft's window on a session: which of its chain's positions the KV cache holds, and where each sits there.

The draft only guesses (the target verifies every token), so it may condition on less than the whole sequence
without changing the output. A windowed session's KV holds the chain's first `sink` tokens (the start of the system
prompt: StreamingLLM's attention sinks) and then the chain from `sink + offset` on, at most `size` of them:

    chain    t0 t1 | t2 t3 t4 t5 | t6 t7 t8 t9      sink 2, offset 4 (two grid steps of 2)
    KV       t0 t1 |             | t6 t7 t8 t9      KV position = chain position - offset, past the sink

so its prompt read costs at most sink + size tokens and its per-token time stays at the short-context level however
long the session grows. The offset moves on a grid of size / 2: the KV drops half a window at once (llama.cpp's
K-shift moves the rest down, no recompute), and a later turn, whose prompt extends this one's sequence, lands on the
same grid and finds the same tokens at the same KV positions (duo.llama.context.Context.adopt_prefix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from duo.llama.errors import ModelError


# duo-draft --window and --window-sink by default (scripts/measure_window.py).
DEFAULT_WINDOW = 2048
DEFAULT_SINK = 4
# The shortest window duo-draft takes: half of it must hold a chain's lead over its commits (the target's max_ahead).
MIN_WINDOW = 128


@dataclass(frozen=True)
class Window:
    """How much of a session the draft's KV holds: `size` tokens after the first `sink` (size 0: the whole chain)."""

    size: int = 0
    sink: int = 0

    @property
    def grid(self) -> int:
        """The step the offset moves by: half a window, so that a move is rare and turns share a grid."""
        return max(1, self.size // 2)

    @property
    def cells(self) -> int:
        """The most positions a windowed chain's sequence holds (0: unbounded)."""
        return self.sink + self.size if self.size else 0

    def offset_for(self, length: int, current: int = 0) -> int:
        """The offset for a chain of `length` tokens, never back from `current` while the chain still reaches past
        it (a rejection shortens the chain by a few tokens: the window does not move back for them)."""
        over = max(0, length - self.sink - self.size) if self.size else 0
        grid_offset = -(-over // self.grid) * self.grid  # the first grid step that brings the view within size
        return max(grid_offset, current) if length > self.sink + current else grid_offset

    def view(self, tokens: Sequence[int], offset: int) -> list[int]:
        """The tokens of a chain (or a branch: the chain up to its fork, then its own) as the KV holds them."""
        if not offset:
            return list(tokens)
        return list(tokens[:self.sink]) + list(tokens[self.sink + offset:])

    def chain_position(self, kv_position: int, offset: int) -> int:
        """The chain position of what the KV holds at `kv_position`."""
        return kv_position if kv_position < self.sink else kv_position + offset

    def kv_position(self, position: int, offset: int) -> int:
        """Where the chain's `position` sits in the KV; ModelError where the window dropped it."""
        if position < self.sink:
            return position
        if position < self.sink + offset:
            raise ModelError(f"chain position {position} is before the draft's window (it holds the first "
                             f"{self.sink} and those from {self.sink + offset} on)")
        return position - offset
