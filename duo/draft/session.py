"""One target session as the draft sees it: its chain, branches and doubts, what it drafts next, how it draws."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from duo.constraint import Cursor
from duo.draft.branches import Branch, Doubt, branch_length, doubt_of
from duo.draft.confidence import SoftmaxScale, softmax_scale
from duo.draft.guess import GuessRate
from duo.draft.value import Calibration, Horizon, Round, ranked_rounds
from duo.draft.window import Window
from duo.lookup import ContextLookup
from duo.llama.context import common_prefix_length
from duo.sampling import rows
from duo.sampling.coupled import coupled_race, coupled_ranking
from duo.sampling.distributions import SparseDist, advance, distribution, sample
from duo.sampling.ops.penalties import OutputCounts, Penalties
from duo.sampling.params import SamplingParams

# A token drawn: (its id, the distribution it was drawn from or None where none travels, its Doubt or None).
Drawn = tuple[int, SparseDist | None, Doubt | None]


@dataclass(frozen=True)
class Slot:
    """The sequence ids a session's tokens live under in the draft's shared KV cache."""

    chain: int
    # Its branches' sequence (None: the draft drafts no branches). A branch shares the chain's prefix up
    # to its fork without recomputing it (duo.llama.context.Context.fork).
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
    n_ctx: int  # positions it may reach (duo-draft --ctx-size; unbounded with a window: the target bounds it)
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
    calibration: Calibration = field(default_factory=Calibration)  # what commits showed of its drafts
    # What the KV cache holds, model thread only: the chain's sequence, the branch sequence, and how
    # many of the branch's first positions are the chain's own cells (a fork copies no cell).
    # With a window (duo.draft.window) both hold the window's view: the chain's positions from sink + offset on sit
    # `offset` KV positions lower.
    kv_tokens: list[int] = field(default_factory=list)
    branch_kv: list[int] = field(default_factory=list)
    branch_shared: int = 0
    window: Window = Window()
    offset: int = 0
    # The output starts at position output_start. Its grammar (duo.constraint): what the chain draws is masked with
    # `cursor`, what branches draw with a copy of it (each walks its own sequence; model thread only). Its
    # penalties transform what it draws from, after the output before each position (duo.sampling.ops.penalties).
    cursor: Cursor | None = None
    branch_cursor: Cursor | None = None
    output_start: int = 0
    penalties: Penalties = Penalties()
    output_counts: OutputCounts | None = None  # what the penalties count of the committed output (model thread)
    # Where the target lets it guess from the context (duo.draft.guess): an index of the committed tokens, and how
    # often its draws follow a guess.
    lookup: ContextLookup | None = None
    guess_rate: GuessRate | None = None
    # Mirostat's state (duo.sampling.ops.mirostat): the target's after the committed tokens, and the draft's own walk
    # along its chain from there (chain position -> mu before its token; model thread writes, commits prune).
    committed_mu: float | None = None
    mus: dict[int, float] = field(default_factory=dict)

    @property
    def rejection_sampled(self) -> bool:
        """Whether the target verifies this session's tokens with their q (RESIDUAL), so they travel."""
        return not self.params.greedy and self.coupled_seed is None

    def wants_to_draft(self) -> bool:
        return (not self.paused and not self.closed and len(self.chain) - self.committed < self.max_ahead
                and len(self.chain) < self.n_ctx)

    def offered_rounds(self) -> list[Round]:
        """What this session offers the next decode, worth most first (duo.draft.value.ranked_rounds): its
        chain's lead, its best branch round, or both; [] when nothing is worth drafting."""
        if self.closed or not self.max_ahead:
            return []
        branching = bool(self.max_branches)
        horizon = Horizon(chain_open=self.wants_to_draft(),
                          fork_limit=self.chain_held() + 1 if branching else 0,
                          branch_cap=branch_length(self.max_ahead, self.branch_len) if branching else 0,
                          new_branches=self.max_branches - len(self.branches))
        return ranked_rounds(self.committed, len(self.chain), self.doubts, self.branches, horizon, self.calibration)

    def chain_held(self) -> int:
        """The chain's positions up to which the KV holds it (the window's dropped ones count as held)."""
        held = common_prefix_length(self.kv_tokens, self.window.view(self.chain, self.offset))
        return self.window.chain_position(held, self.offset) if held > self.window.sink else held

    def take(self, rounds: list[Round]) -> None:
        """Note that `rounds` go into the next decode: a new branch takes over the branch sequence, so the
        one growing there (if any) stops growing."""
        if any(round_.fork is not None and round_.growing is None for round_ in rounds):
            for branch in self.branches:
                branch.finished = True

    def guess(self, most: int) -> list[int]:
        """At most `most` tokens the context proposes after the chain (duo.lookup), [] where it does not guess."""
        if self.lookup is None or most <= 0:
            return []
        return self.lookup.propose(self.chain[self.committed:], most)

    def transform(self, logits: np.ndarray, tokens: list[int], committed: int, allowed: np.ndarray | None) -> None:
        """Transform `logits`, the row after `tokens`, with the penalties and the grammar's mask `allowed` (None: no
        grammar) by the pipeline the target verifies with (duo.sampling.rows; model thread)."""
        counted = self._counted(logits.size, tokens, committed) if self.penalties.active else None
        rows.transform(self.penalties, logits[None], tokens[:committed], tokens[committed:], counted,
                       None if allowed is None else [allowed])

    def _counted(self, n_vocab: int, tokens: list[int], committed: int) -> OutputCounts:
        """output_counts, caught up: of the output in `tokens`, the part committed when its work was planned
        (tokens[:committed]) is counted once: commits only append, and works run in the order they were planned, so
        the counts always hold a prefix of it."""
        if self.output_counts is None:
            self.output_counts = OutputCounts(n_vocab)
        self.output_counts.extend(tokens[self.output_start + len(self.output_counts.tokens):committed])
        return self.output_counts

    def mu_at(self, position: int) -> float | None:
        """Mirostat's mu for the token at `position`: the draft's walk where it drew the chain up to there, else the
        target's after the committed tokens (None without mirostat)."""
        return self.mus.get(position, self.committed_mu)

    def cells_held(self) -> int:
        """KV cells its sequences hold (model thread): cells the branch shares with the chain count once."""
        return len(self.kv_tokens) + len(self.branch_kv) - self.branch_shared

    def new_epoch(self) -> int:
        epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
        return epoch

    def apply_commit(self, start: int, tokens: Sequence[int], mu: float | None = None) -> None:
        """Keep the chain where the target agreed with it; else take the branch that assumed what the
        target committed, or restart the chain (a new epoch) from the commit. `mu`: mirostat's state after it."""
        end = start + len(tokens)
        self.commits += 1
        agreed = common_prefix_length(self.chain[start:end], tokens)
        if mu is not None:  # the walk goes on from the target's mu, along the chain where it still holds
            kept = list(self.mus.items()) if agreed == len(tokens) else []  # a copy: the model thread writes
            self.mus = {position: value for position, value in kept if position > end}
            self.committed_mu = mu
        self._judge(start, tokens, agreed)
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
        if self.lookup is not None:
            self.lookup.tokens.extend(tokens)  # commits continue the committed sequence (Drafter.commit checks)
        self.committed = end
        self.paused = False

    def _judge(self, start: int, tokens: Sequence[int], agreed: int) -> None:
        """Tell the calibration which drafted tokens the commit kept, and what replaced the first it did not."""
        drafted = len(self.chain) - start  # the chain's positions from start on hold drafts
        for i in range(min(agreed + 1, len(tokens), drafted)):
            self.calibration.judge(self.doubts.get(start + i), i < agreed, tokens[i])


def proposes(logits: np.ndarray, p_min: float, scale: SoftmaxScale | None = None) -> bool:
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
    `scale`: the row's softmax scale where the caller has it already (the draft computes it for every token's
    confidence, duo.draft.confidence).
    """
    if p_min <= 0:
        return True
    return (scale or softmax_scale(logits)).top_probability >= p_min


def draw(session: DraftSession, logits: np.ndarray, position: int, chain: bool = True) -> Drawn:
    """The token at `position` after these logits, the distribution it was drawn from (None where the
    target needs none: coupled sessions) and, when the session drafts branches, its Doubt. Under mirostat, a draw
    on the chain (not a branch) walks the draft's mu on to the next position."""
    if session.coupled_seed is not None:
        return draw_coupled(session, logits, position, chain)
    mu = session.mu_at(position)
    dist = distribution(logits, session.params, mu)
    token = sample(dist, session.rng)
    if mu is not None and chain:
        session.mus[position + 1] = advance(session.params, mu, dist, token)
    doubt = doubt_of(logits, token, dist, session.params.greedy) if session.max_branches else None
    return token, dist, doubt


def draw_coupled(session: DraftSession, logits: np.ndarray, position: int,
                 chain: bool = True) -> tuple[int, None, Doubt | None]:
    """The draft's coupled sample: the winner of the race that decides the target's token, run with
    q instead of p. Its runner-up is the branch's alternative: when the target's race ends otherwise,
    the token that came second with q is the likeliest winner with p."""
    n, mu = 2 if session.max_branches else 1, session.mu_at(position)
    if mu is None:
        ids, keys = coupled_race(logits, session.params, session.coupled_seed, position, n)
    else:
        dist = distribution(logits, session.params, mu)
        ids, keys = coupled_ranking(dist, session.coupled_seed, position, n)
        if chain:
            session.mus[position + 1] = advance(session.params, mu, dist, int(ids[0]))
    if not session.max_branches:
        return int(ids[0]), None, None
    alternative = int(ids[1]) if ids.size > 1 else None
    return int(ids[0]), None, Doubt(float(keys[0] - keys[1]) if ids.size > 1 else np.inf, alternative, None)
