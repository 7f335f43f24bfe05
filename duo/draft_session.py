"""One target session as the draft sees it: its chain, branches and doubts, what it drafts next, how it draws."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from duo.branches import Branch, Doubt, branch_length, choose_fork, doubt_of, preferred_draft_len
from duo.model import common_prefix_length
from duo.sampling import SamplingParams, SparseDist, coupled_ranking, distribution, sample

# DraftSession.next_work's priorities.
CHAIN_NEEDED, BRANCH, CHAIN_AHEAD = 0, 1, 2

# A token drawn: (its id, the distribution it was drawn from or None where none travels, its Doubt or None).
Drawn = tuple[int, SparseDist | None, Doubt | None]


@dataclass(frozen=True)
class Slot:
    """The sequence ids a session's tokens live under in the draft's shared KV cache."""

    chain: int
    # Its branches' sequence (None: the draft drafts no branches). A branch shares the chain's prefix up
    # to its fork without recomputing it (duo.model.Context.fork).
    branch: int | None


@dataclass(eq=False)  # a session is an identity (sessions key dicts), not a value
class DraftSession:
    """One target session as the draft sees it: the committed tokens followed by its own chain."""

    session_id: int
    chain: list[int]  # committed tokens, then drafted ones
    committed: int
    params: SamplingParams
    rng: np.random.Generator
    max_ahead: int
    p_min: float
    slot: Slot
    n_ctx: int  # positions it may reach (duo-draft --ctx-size)
    coupled_seed: int | None = None  # COUPLED sessions: propose the coupled sample with this seed's noise
    epoch: int = 0
    paused: bool = False  # after a doubtful position (p_min) or an end of generation, until the next commit
    closed: bool = False
    max_branches: int = 0     # branches drafted in spare time (0: none)
    branch_len: int = 0       # tokens after a branch's assumed one (0: steered by max_ahead)
    next_epoch: int = 1       # epochs number chains and branches alike, in the order they start
    commits: int = 0          # commits applied: a step drafted before the latest one is stale
    doubts: dict[int, Doubt] = field(default_factory=dict)  # chain position -> doubt (with branches only)
    branches: list[Branch] = field(default_factory=list)    # of the current chain, in the order drafted
    # What the KV cache holds, model thread only: the chain's sequence, the branch sequence, and how
    # many of the branch's first positions are the chain's own cells (a fork copies no cell).
    kv_tokens: list[int] = field(default_factory=list)
    branch_kv: list[int] = field(default_factory=list)
    branch_shared: int = 0

    @property
    def rejection_sampled(self) -> bool:
        """Whether the target verifies this session's tokens with their q (RESIDUAL), so they travel."""
        return not self.params.greedy and self.coupled_seed is None

    def wants_to_draft(self) -> bool:
        return (not self.paused and not self.closed and len(self.chain) - self.committed < self.max_ahead
                and len(self.chain) < self.n_ctx)

    def next_work(self) -> int | None:
        """What the draft should do next for this session, as a priority (lower first), or None:
        CHAIN_NEEDED while the chain holds fewer drafts than the target's next verify step wants,
        then BRANCH for the likeliest rejection within that step, then CHAIN_AHEAD up to max_ahead,
        then more branches.

        A branch at a doubtful position inside the next verify step pays when the target rejects
        there (it then skips a step decoded alone), which is likelier than the far end of the chain
        being needed before the draft could draft it anyway.
        """
        if self.closed:
            return None
        needed = preferred_draft_len(self.max_ahead) + 1
        if self.wants_to_draft() and len(self.chain) - self.committed < needed:
            return CHAIN_NEEDED
        # One branch for the next step comes first; more only once the chain is as far ahead as
        # allowed: each costs the chain a few tokens of lead, and the steps after the next want those.
        if (not self.branches or self.growing_branch()) and self.wants_to_branch(needed):
            return BRANCH
        if self.wants_to_draft():
            return CHAIN_AHEAD
        return BRANCH if self.wants_to_branch(len(self.chain) - self.committed) else None

    def planned_branch(self) -> tuple[Branch | None, int | None]:
        """(the branch to grow, or None for a new one; the fork), as next_work planned it: the growing
        branch, else a fork in the next step's positions, else, with the chain full, in all of them."""
        growing = self.growing_branch()
        if growing is not None:
            return growing, growing.fork
        fork = self.next_fork(preferred_draft_len(self.max_ahead) + 1)
        if fork is None and not self.wants_to_draft():
            fork = self.next_fork(len(self.chain) - self.committed)
        return None, fork

    def wants_to_branch(self, within: int) -> bool:
        """Whether a branch is unfinished, or may start among the first `within` undecided positions."""
        if not self.max_branches or not self.current_branch_len():
            return False
        return self.growing_branch() is not None or self.next_fork(within) is not None

    def current_branch_len(self) -> int:
        return branch_length(self.max_ahead, self.branch_len)

    def growing_branch(self) -> Branch | None:
        return next((branch for branch in self.branches if not branch.finished), None)

    def next_fork(self, within: int) -> int | None:
        """Where the next branch forks: the least sure of the first `within` undecided positions whose
        prefix the KV cache holds (the branch shares it), while fewer than max_branches exist."""
        if len(self.branches) >= self.max_branches:
            return None
        synced = common_prefix_length(self.kv_tokens, self.chain)
        return choose_fork(self.doubts, self.committed, min(synced + 1, len(self.chain), self.committed + within),
                           {branch.fork for branch in self.branches})

    def cells_held(self) -> int:
        """KV cells its sequences hold (model thread): cells the branch shares with the chain count once."""
        return len(self.kv_tokens) + len(self.branch_kv) - self.branch_shared

    def new_epoch(self) -> int:
        epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
        return epoch

    def apply_commit(self, start: int, tokens: Sequence[int]) -> None:
        """Keep the chain where the target agreed with it; else take the branch that assumed what the
        target committed, or restart the chain (a new epoch) from the commit."""
        end = start + len(tokens)
        self.commits += 1
        agreed = common_prefix_length(self.chain[start:end], tokens)
        if agreed == len(tokens):
            self.branches = [branch for branch in self.branches if branch.fork >= end]  # the rest were wrong
        else:
            fork = start + agreed
            taken = next((branch for branch in self.branches
                          if branch.fork == fork and branch.tokens[:end - fork] == list(tokens[agreed:])), None)
            if taken is not None:
                # The target took this branch as its chain too (proto/duo.proto: branch).
                self.chain = self.chain[:fork] + taken.tokens
                self.epoch = taken.epoch
                self.doubts.update((fork + i, doubt) for i, doubt in enumerate(taken.doubts) if doubt)
            else:
                # The commit contradicted the chain or ran past it: restart from the committed sequence.
                # Its KV entries stay where they match; the next step rolls the cache back to the fork.
                self.chain = self.chain[:start] + list(tokens)
                self.epoch = self.new_epoch()
            self.branches = []
        self.doubts = {position: doubt for position, doubt in self.doubts.items()
                       if end <= position < len(self.chain)}
        self.committed = end
        self.paused = False


def proposes(logits: np.ndarray, p_min: float) -> bool:
    """--draft-p-min's rule: propose a token at this position unless the draft's top-1 probability
    (at temperature 1, as llama.cpp's common/speculative.cpp does) is below p_min.

    The decision must not depend on the token drawn. The target verifies a proposal x with the q it
    was declared to come from, which assumes x ~ q. Dropping x because q(x) < p_min would make the
    sent tokens follow q cut to its confident tokens instead: with target p = [0.5, 0.5], draft
    q = [0.9, 0.1] and p_min 0.2, token 0 is sent 90% of the time and accepted with p/q = 5/9,
    token 1 is dropped and the target samples alone, so P(0) = 0.9 * 5/9 + 0.1 * 0.5 = 0.55, not
    0.5. The top-1 probability depends only on the tokens before this position, so whether it gets
    a proposal is independent of the proposal: a sent x follows q exactly (and verification makes
    the output follow p), and a position without one is sampled from p by the target itself.
    """
    if p_min <= 0:
        return True  # a softmax over the whole vocabulary is worth skipping on every drafted token
    shifted = logits.astype(np.float64) - logits.max()
    return bool(1.0 / np.exp(shifted).sum() >= p_min)


def draw(session: DraftSession, logits: np.ndarray, position: int) -> Drawn:
    """The token at `position` after these logits, the distribution it was drawn from (None where the
    target needs none: coupled sessions) and, when the session drafts branches, its Doubt."""
    dist = distribution(logits, session.params)
    if session.coupled_seed is not None:
        return draw_coupled(session, dist, position)
    token = sample(dist, session.rng)
    doubt = doubt_of(logits, token, dist, session.params.greedy) if session.max_branches else None
    return token, dist, doubt


def draw_coupled(session: DraftSession, dist: SparseDist, position: int) -> tuple[int, None, Doubt | None]:
    """The draft's coupled sample: the winner of the race that decides the target's token, run with
    q instead of p. Its runner-up is the branch's alternative: when the target's race ends otherwise,
    the token that came second with q is the likeliest winner with p."""
    ids, keys = coupled_ranking(dist, session.coupled_seed, position, n=2 if session.max_branches else 1)
    if not session.max_branches:
        return int(ids[0]), None, None
    alternative = int(ids[1]) if ids.size > 1 else None
    return int(ids[0]), None, Doubt(float(keys[0] - keys[1]) if ids.size > 1 else np.inf, alternative, None)


