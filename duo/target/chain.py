"""The target's view of one session's draft chain and its branches: which received draft tokens may be verified."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from duo.sampling.distributions import SparseDist
from duo.net.wire import MAX_BRANCHES


@dataclass
class Line:
    """A chain or a branch: tokens of one epoch at positions start, start + 1, ..."""

    epoch: int
    start: int
    tokens: list[int] = field(default_factory=list)
    dists: list[SparseDist | None] = field(default_factory=list)
    # The draft model's probability of each token (None: the draft sent none, or the branch's assumed token).
    confidences: list[float | None] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def first_conflict(self, committed: Sequence[int]) -> int | None:
        """The first position where this line contradicts a committed token, if any."""
        for position in range(self.start, min(self.end, len(committed))):
            if self.tokens[position - self.start] != committed[position]:
                return position
        return None

    def drop_committed(self, n_committed: int) -> None:
        """Forget tokens now committed: they are no longer needed for verification."""
        overlap = min(self.end, n_committed) - self.start
        if overlap > 0:
            del self.tokens[:overlap], self.dists[:overlap], self.confidences[:overlap]
            self.start += overlap


@dataclass
class DraftChain:
    """Draft tokens received for a session, kept only while they agree with the committed sequence.

    A chain of epoch e starting at position s was drafted on committed[0:s]; each of its tokens at a
    position p < len(committed) must equal committed[p], otherwise every later token of the chain
    was drafted on a wrong prefix and is useless. Example: committed = [7, 8, 9] (prompt [7, 8]
    plus one committed token 9) and a chain of epoch 2 starting at 2 holds [9, 4, 5]: 9 matches,
    so [4, 5] are pending at positions 3 and 4. Had it held [6, 4, 5], the chain would be dead
    until the draft starts epoch 3.

    Branches (proto/duo.proto) wait beside the chain. Example: the chain of epoch 2 holds [4, 5, 6]
    at positions 3..5 and a branch of epoch 3 forks at 4 with [8, 1, 2]. If the target rejects 5
    and commits 8 at position 4, the branch becomes the chain and [1, 2] are pending at once; had
    it committed anything else there, chain and branch would both be dead.
    """

    committed: list[int]
    main: Line | None = None
    branches: dict[int, Line] = field(default_factory=dict)
    newest_epoch: int = -1  # epochs only grow: a chunk of an older, unknown one is stale
    died: tuple[int, int] | None = None  # (epoch, position) of the chain a commit contradicted last
    received: int = 0  # chain tokens that arrived (for stats), stale ones included
    branch_hits: int = 0  # branches that took over the chain (for stats)
    # (committed tokens, chain epoch, position) when the draft said it paused that chain there; it holds
    # until the next commit (the draft then drafts again, and tells again if it pauses again).
    pause: tuple[int, int, int] | None = None

    @property
    def epoch(self) -> int:
        """The chain's epoch (-1: none)."""
        return self.main.epoch if self.main else -1

    @property
    def live_epochs(self) -> frozenset[int]:
        """The epochs of the lines held: a chunk of an older epoch outside them is stale."""
        return frozenset(self.branches) | ({self.main.epoch} if self.main else set())

    def receive(self, epoch: int, start: int, tokens: Sequence[int], dists: Sequence[SparseDist | None],
                branch_of: int | None = None, paused: bool = False, confidences: Sequence[float] = ()) -> None:
        """Take a chunk of line `epoch` holding `tokens` at positions start, start+1, ... (`confidences`: the draft
        model's probability of each, as the link checked them; empty from a draft that sends none)"""
        self.received += len(tokens)
        entries = list(dists) if len(dists) == len(tokens) else [None] * len(tokens)
        sure: list[float | None] = list(confidences) if len(confidences) == len(tokens) else [None] * len(tokens)
        if branch_of is not None:
            self._open_branch(Line(epoch, start, list(tokens), [None] + entries[1:], [None] + sure[1:]), branch_of)
        elif self.main is not None and epoch == self.main.epoch:
            self._extend(self.main, start, tokens, entries, sure)
        elif epoch in self.branches:
            self._extend(self.branches[epoch], start, tokens, entries, sure)
        elif epoch > self.newest_epoch:
            # The draft restarted its chain from the committed tokens: every older line is moot. A new
            # chain is anchored at a committed position; one beyond it would be a protocol error.
            self.newest_epoch, self.branches, self.died = epoch, {}, None
            self.main = Line(epoch, start, list(tokens), entries, sure) if start <= len(self.committed) else None
        self.on_commit()
        if paused and self.main is not None and epoch == self.main.epoch and start + len(tokens) == self.main.end:
            self.pause = (len(self.committed), epoch, self.main.end)

    def draft_paused(self) -> bool:
        """Whether the draft said it drafts no more of the current chain before the next commit."""
        main = self.main
        return (self.pause is not None and main is not None and main.end >= len(self.committed)
                and self.pause == (len(self.committed), main.epoch, main.end))

    def _open_branch(self, branch: Line, parent: int) -> None:
        """Keep a branch of the current chain that forks at an undecided position within it; or take
        one that arrived just after the commit it assumed (it was on its way) as the chain."""
        main = self.main
        if branch.epoch <= self.newest_epoch:
            return
        # Known from now on, kept or not: its later chunks (no branch_of) are its own, never a new chain.
        self.newest_epoch = branch.epoch
        if main is None and self.died == (parent, branch.start):
            self.died = None
            if branch.first_conflict(self.committed) is None:
                self.main = branch
                self.branch_hits += 1
            return
        if (main is None or parent != main.epoch or not len(self.committed) <= branch.start <= main.end
                or len(self.branches) >= MAX_BRANCHES):
            return
        self.branches[branch.epoch] = branch

    def _extend(self, line: Line, start: int, tokens: Sequence[int], dists: list[SparseDist | None],
                confidences: list[float | None]) -> None:
        if start != line.end:  # a gap within one epoch: the stream lost order; wait for a new epoch
            self._drop(line)
            return
        line.tokens.extend(tokens)
        line.dists.extend(dists)
        line.confidences.extend(confidences)

    def _drop(self, line: Line) -> None:
        if line is self.main:
            self.main, self.branches = None, {}
        else:
            self.branches.pop(line.epoch, None)

    def on_commit(self) -> None:
        """Call after `committed` grew: drop what is now committed or contradicted; a branch that assumed
        the committed token where the chain was wrong takes its place."""
        n = len(self.committed)
        if self.main is not None:
            conflict = self.main.first_conflict(self.committed)
            # A chain the commits ran past may also be continued by a branch forking at its end.
            fork = conflict if conflict is not None else (self.main.end if self.main.end < n else None)
            taken = self._survivor(fork) if fork is not None else None
            if taken is not None:
                self.main, self.branches = taken, {}
                self.branch_hits += 1
            elif conflict is not None:
                self.died = (self.main.epoch, conflict)
                self.main, self.branches = None, {}
        if self.main is not None:
            self.main.drop_committed(n)
        # A branch whose fork is decided lost: the chain was right there, or another branch took over.
        self.branches = {epoch: branch for epoch, branch in self.branches.items() if branch.start >= n}

    def _survivor(self, fork: int) -> Line | None:
        """The longest branch forking at `fork` that agrees with every committed token."""
        agreeing = [branch for branch in self.branches.values()
                    if branch.start == fork and branch.first_conflict(self.committed) is None]
        return max(agreeing, key=lambda branch: len(branch.tokens), default=None)

    def reset(self) -> None:
        """Forget the chain (the draft went away); the next chunk of any epoch starts afresh."""
        self.main, self.branches, self.newest_epoch, self.died, self.pause = None, {}, -1, None, None

    def has_pending(self) -> bool:
        """Whether pending() holds any token (without copying them)."""
        return self.main is not None and self.main.end > len(self.committed)

    def pending(self) -> tuple[list[int], list[SparseDist | None]]:
        """Chain tokens at positions len(committed), len(committed)+1, ... that may be verified now."""
        if self.main is None:
            return [], []
        offset = len(self.committed) - self.main.start
        return self.main.tokens[offset:], self.main.dists[offset:]

    def pending_confidences(self) -> list[float | None]:
        """The draft model's probability of each of pending()'s tokens (None where it sent none)."""
        if self.main is None:
            return []
        return self.main.confidences[len(self.committed) - self.main.start:]
