"""The target's view of one session's draft chain: which received draft tokens may still be verified."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from duo.sampling import SparseDist


@dataclass(frozen=True)
class ChainChunk:
    """Chain tokens at positions start, start + 1, ... of chain `epoch`, as the link let them through."""

    epoch: int
    start: int
    tokens: list[int]
    dists: list[SparseDist]  # the distribution each token was drawn from; empty for greedy sessions


@dataclass
class DraftChain:
    """Draft tokens received for a session, kept only while they agree with the committed sequence.

    A chain of epoch e starting at position s was drafted on committed[0:s]; each of its tokens at a
    position p < len(committed) must equal committed[p], otherwise every later token of the chain
    was drafted on a wrong prefix and is useless. Example: committed = [7, 8, 9] (prompt [7, 8]
    plus one committed token 9) and a chain of epoch 2 starting at 2 holds [9, 4, 5]: 9 matches,
    so [4, 5] are pending at positions 3 and 4. Had it held [6, 4, 5], the chain would be dead
    until the draft starts epoch 3.
    """

    committed: list[int]
    epoch: int = -1
    start: int = 0
    tokens: list[int] = field(default_factory=list)
    dists: list[SparseDist | None] = field(default_factory=list)
    alive: bool = False
    received: int = 0  # chain tokens that arrived (for stats), stale ones included

    def receive(self, epoch: int, start: int, tokens: Sequence[int], dists: Sequence[SparseDist | None]) -> None:
        """Take a chunk of chain `epoch` holding `tokens` at positions start, start+1, ..."""
        self.received += len(tokens)
        if epoch < self.epoch:
            return  # drafted before the draft learned of a commit that contradicted it
        if epoch > self.epoch:
            self.epoch, self.start, self.tokens, self.dists = epoch, start, [], []
            # A new chain is anchored at a committed position; one beyond it would be a protocol error.
            self.alive = start <= len(self.committed)
        elif start != self.end:
            self.alive = False  # a gap within one epoch: the stream lost order; wait for a new epoch
        if not self.alive:
            return
        self.tokens.extend(tokens)
        self.dists.extend(dists if len(dists) == len(tokens) else [None] * len(tokens))
        self._check_against_committed()

    def on_commit(self) -> None:
        """Call after `committed` grew: drop chain tokens now committed, or the chain if it was contradicted."""
        if self.alive:
            self._check_against_committed()

    def reset(self) -> None:
        """Forget the chain (the draft went away); the next chunk of any epoch starts afresh."""
        self.epoch, self.start, self.tokens, self.dists, self.alive = -1, 0, [], [], False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def pending(self) -> tuple[list[int], list[SparseDist | None]]:
        """Chain tokens at positions len(committed), len(committed)+1, ... that may be verified now."""
        if not self.alive:
            return [], []
        offset = len(self.committed) - self.start
        return self.tokens[offset:], self.dists[offset:]

    def _check_against_committed(self) -> None:
        n_committed = len(self.committed)
        overlap = min(self.end, n_committed) - self.start
        if overlap <= 0:
            return
        if self.tokens[:overlap] != self.committed[self.start:self.start + overlap]:
            self.alive = False
            self.tokens, self.dists = [], []
            return
        # Tokens now committed are no longer needed for verification.
        del self.tokens[:overlap], self.dists[:overlap]
        self.start += overlap
