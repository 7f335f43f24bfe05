"""A pool's capacity on a simulated clock: N greedy sessions served by one duo-target and D drafts, from measured costs.

Where a box has no cores for the drafts a pool would have, its capacity is simulated from what was measured of
each model: T(n), the target's seconds for one call of n tokens, and d(m), a draft's seconds for one round
drafting a token for each of m sessions. Each draft is assumed to run on cores of its own.

- N sessions start together and each generates `tokens` tokens (no prompt is read: prefill is left out).
- The target steps every running session in one batched call (duo.target.batching): a session's verify batch
  is its pending drafts, at most k, plus one token; the call costs batch_cost(T, the call's tokens) (on a CPU
  a call's cost follows its tokens, not how they split into sequences). The next call starts as soon as one
  ends: the target never waits for drafts.
- A drafted token is *sound* while every token of its chain up to it equals the target's own: each keeps its
  chain sound with probability a (the measured per-token acceptance), independently. A step accepts its
  batch's leading sound drafts and commits them plus one token of the target's. When every draft of the
  batch was accepted, that token keeps the chain alive if the draft's own token there was sound. The target
  holds (and verifies, at their cost) a chain's tokens past an unsound one until a step finds it; tokens of a
  chain that a commit contradicts are dropped when they arrive (the real target's epochs).
- A draft runs rounds back to back: each drafts one token for every session of its own whose chain is less
  than max_ahead = 2k + 2 ahead of the commit it last heard of (the length the target's adaptive policy
  steers it to for k), and costs d(m) for m sessions. Chunks reach the target and commits reach the draft
  after the link's one-way delay. A commit that shows an unsound chain voids it: the draft drafts afresh
  from the committed tokens at its next round (a round in progress when the commit came is wasted).
- Placement is the pool's own: duo.target.pool.placement's `choose` places each session, and every
  REBALANCE_S `better_home` may move one session (the pool's rule: the newest one past MOVE_COOLDOWN_S),
  fed as the real pool feeds it: each draft's pace per token at its load and its latency after a starving
  commit (timed from the chunks' arrivals as duo.target.generation times them), its acceptance from the
  steps. A moved session starts afresh on its new draft; the new draft's prefill of its tokens is not charged.
- Left out: the target's adaptive policy and its switch (k is fixed per run; `best_k` tries several and
  keeps the fastest, as duo.bench.pace_bound does), waits for drafts, branches, the context lookup.
  The target alone is the same loop with no draft: every call decodes one token per running session.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

from duo.bench.pace_bound import batch_cost
from duo.costs import MovingAverage
from duo.target.pool.placement import MOVE_COOLDOWN_S, DraftView, better_home, choose
from duo.target.pool.pool import REBALANCE_S

KS = tuple(range(1, 9))  # the draft lengths best_k tries


@dataclass(frozen=True)
class DraftSpec:
    """One simulated draft: d(m) by m (measured sizes, interpolated as T(n) is), its acceptance, its link."""

    name: str
    round_costs: dict[int, float]
    acceptance: float
    link_s: float = 0.001  # one-way: a loopback gRPC message, about a millisecond


@dataclass(frozen=True)
class Outcome:
    """One run (or the mean of several seeds' runs) of N sessions."""

    clients: int
    k: int
    seconds: float                       # until the last session finished
    tokens_per_second: float             # all sessions' tokens over `seconds`
    per_client_tokens_per_second: float  # mean over sessions of tokens / its own time
    tokens_per_session_step: float       # committed per session per call
    starved_share: float                 # session-steps that verified no draft
    placed: dict[str, int]               # per draft: sessions placed on it at the start
    mean_sessions: dict[str, float]      # per draft: sessions placed on it, averaged over the calls' time
    busy: dict[str, float]               # per draft: the share of `seconds` it spent in rounds
    moves: float


@dataclass(frozen=True)
class _Drafted:
    """A drafted token as it reaches the target: its draft, its position, its chain's first unsound position."""

    draft: str
    position: int
    first_unsound: float  # math.inf: none up to this token

    @property
    def sound(self) -> bool:
        return self.first_unsound > self.position


@dataclass
class _Line:
    """A session's chain on its draft: `drafted` tokens past `base`, the last commit it heard of."""

    base: int
    drafted: int = 0
    first_unsound: float = math.inf
    generation: int = 0  # bumped when the chain is voided: a round's token for an older generation is dropped


@dataclass
class _Session:
    """A client's generation as the target holds it: what it committed, the drafts it has, its draft."""

    sid: int
    committed: int = 0
    pending: list[_Drafted] = field(default_factory=list)  # arrived drafts for committed + 1, committed + 2, ...
    home: _Draft | None = None
    moved_at: float = 0.0
    finished_at: float | None = None
    # What duo.target.generation times the draft's pace and latency from.
    starved_since: float | None = None
    last_commit_at: float = 0.0
    last_chunk_at: float = 0.0


@dataclass
class _Draft:
    """A draft process: its sessions' chains, what placement knows of it, whether a round is running."""

    spec: DraftSpec
    view: DraftView
    lines: dict[int, _Line] = field(default_factory=dict)
    latency: MovingAverage = field(default_factory=lambda: MovingAverage(0.0))
    busy: bool = False
    busy_seconds: float = 0.0


class _Clock:
    """Callbacks run in time order (ties in the order they were scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def after(self, seconds: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (self.now + seconds, next(self._order), callback))

    def run(self) -> None:
        while self._queue:
            self.now, _, callback = heapq.heappop(self._queue)
            callback()


class _Pool:
    """One run: the target's loop, each draft's rounds, the links between them and placement."""

    def __init__(self, clients: int, tokens: int, costs: dict[int, float], drafts: Sequence[DraftSpec], k: int,
                 seed: int) -> None:
        self.tokens, self.costs, self.k, self.max_ahead = tokens, costs, k, 2 * k + 2
        self.rng = random.Random(seed)
        self.clock = _Clock()
        self.drafts = [_Draft(spec, DraftView(spec.name)) for spec in drafts]
        self.sessions = [_Session(sid) for sid in range(clients)]
        self.session_steps = self.starved_steps = self.moves = 0
        self.load_seconds = {draft.spec.name: 0.0 for draft in self.drafts}
        self.placed: dict[str, int] = {}

    def run(self) -> Outcome:
        for session in self.sessions:
            self._place(session)
        self.placed = {draft.spec.name: draft.view.sessions for draft in self.drafts}
        if self.drafts:
            self.clock.after(REBALANCE_S, self._rebalance)
        self._step()
        self.clock.run()
        return self._outcome()

    # The target.
    def _running(self) -> list[_Session]:
        return [s for s in self.sessions if s.finished_at is None]

    def _demand(self) -> float:
        """Drafts a second one session can use (duo.target.control's _draft_demand, at this k)."""
        return self.k / batch_cost(self.costs, max(1, len(self._running())) * (self.k + 1))

    def _step(self) -> None:
        """One batched call: each running session's pending drafts, at most k, and one token."""
        running = self._running()
        if not running:
            return
        batches = [min(len(s.pending), self.k) if s.home is not None else 0 for s in running]
        seconds = batch_cost(self.costs, sum(batches) + len(running))
        for draft in self.drafts:
            self.load_seconds[draft.spec.name] += seconds * sum(s.home is draft for s in running)
        self.clock.after(seconds, lambda: self._verified(running, batches))

    def _verified(self, running: list[_Session], batches: list[int]) -> None:
        for session, batch in zip(running, batches):
            self._commit(session, session.pending[:batch])
        self._step()

    def _commit(self, session: _Session, verified: list[_Drafted]) -> None:
        """Accept the leading sound drafts, commit them and the target's own token; tell the draft."""
        accepted = next((i for i, token in enumerate(verified) if not token.sound), len(verified))
        session.committed += accepted + 1
        self.session_steps += 1
        self.starved_steps += not verified
        if session.home is not None and verified:
            session.home.view.observe_acceptance(len(verified), accepted)
        session.pending = [t for t in session.pending if t.position > session.committed and not self._stale(session, t)]
        now = self.clock.now
        session.last_commit_at = now
        session.starved_since = None if session.pending else now
        if session.committed >= self.tokens:
            session.finished_at = now
            self._leave(session)
        elif session.home is not None:
            draft, committed = session.home, session.committed
            self._send(draft, lambda: self._heard_commit(draft, session, committed))

    # The links.
    def _send(self, draft: _Draft, deliver: Callable[[], None]) -> None:
        self.clock.after(draft.spec.link_s, deliver)

    @staticmethod
    def _stale(session: _Session, token: _Drafted) -> bool:
        """Whether the token's chain contradicts the committed tokens (the real target: another epoch)."""
        return token.first_unsound <= session.committed

    def _arrived(self, session: _Session, token: _Drafted) -> None:
        """A chunk reaches the target: timed unless stale, pending if it extends the session's drafts too."""
        if session.home is None or token.draft != session.home.spec.name or session.finished_at is not None:
            return
        if self._stale(session, token):
            return
        if token.position == session.committed + len(session.pending) + 1:
            session.pending.append(token)
        self._time_chunk(session, session.home)

    def _time_chunk(self, session: _Session, draft: _Draft) -> None:
        """As duo.target.generation does: latency after a starving commit, else pace between chunks."""
        now = self.clock.now
        if session.starved_since is not None and session.pending:
            draft.latency.add(now - session.starved_since)
            session.starved_since = None
        elif session.last_chunk_at > session.last_commit_at:
            draft.view.pace.observe(draft.view.sessions, now - session.last_chunk_at)
        session.last_chunk_at = now

    # The drafts.
    def _heard_commit(self, draft: _Draft, session: _Session, committed: int) -> None:
        """The draft learns a commit: it keeps its chain past it if the chain was sound up to it, else voids it."""
        line = draft.lines.get(session.sid)
        if line is None:
            return
        if line.first_unsound <= committed:
            line.drafted, line.first_unsound, line.generation = 0, math.inf, line.generation + 1
        else:
            line.drafted = max(0, line.base + line.drafted - committed)
        line.base = committed
        self._wake(draft)

    def _opened(self, draft: _Draft, session: _Session, committed: int) -> None:
        if session.home is draft and session.finished_at is None:
            draft.lines[session.sid] = _Line(committed)
            self._wake(draft)

    def _wake(self, draft: _Draft) -> None:
        """Start a round if the draft is idle and a session of its own has room to draft."""
        if draft.busy:
            return
        planned = [(sid, line, line.generation, line.base + line.drafted + 1)
                   for sid, line in draft.lines.items() if line.drafted < self.max_ahead]
        if not planned:
            return
        seconds = batch_cost(draft.spec.round_costs, len(planned))
        draft.busy, draft.busy_seconds = True, draft.busy_seconds + seconds
        self.clock.after(seconds, lambda: self._round_done(draft, planned))

    def _round_done(self, draft: _Draft, planned: list[tuple[int, _Line, int, int]]) -> None:
        """Each session's new token joins its chain and goes to the target; one a commit overtook while the round
        ran goes too (the target times it) but joins no chain; one of a chain voided meanwhile is dropped."""
        draft.busy = False
        for sid, line, generation, position in planned:
            if draft.lines.get(sid) is not line or line.generation != generation:
                continue
            if position > line.base:
                line.drafted += 1
                if line.first_unsound == math.inf and self.rng.random() >= draft.spec.acceptance:
                    line.first_unsound = position
                token = _Drafted(draft.spec.name, position, line.first_unsound)
            else:  # a commit heard while the round ran covers its position: its chain so far is the target's
                token = _Drafted(draft.spec.name, position, math.inf)
            session = self.sessions[sid]
            self._send(draft, lambda session=session, token=token: self._arrived(session, token))
        self._wake(draft)

    # Placement: the pool's decisions (duo.target.pool.placement), on the pool's schedule.
    def _recount(self) -> None:
        """Each draft's load as placement and its pace by load read it: the running sessions placed on it."""
        for draft in self.drafts:
            draft.view.sessions = sum(s.home is draft for s in self._running())

    def _views(self) -> list[DraftView]:
        """Placement's view of the drafts, as duo.target.pool.pool's _views keeps it."""
        self._recount()
        for draft in self.drafts:
            draft.view.delay_s = draft.latency.value if draft.latency.weight > 0 else 0.0
        return [draft.view for draft in self.drafts]

    def _draft_of(self, view: DraftView) -> _Draft:
        return next(d for d in self.drafts if d.view is view)

    def _place(self, session: _Session) -> None:
        view = choose(self._views(), self._demand()) if self.drafts else None
        if view is not None:
            self._move(session, self._draft_of(view))

    def _move(self, session: _Session, draft: _Draft) -> None:
        """The session drafts on `draft` from now: afresh, from its committed tokens."""
        if session.home is not None:
            session.home.lines.pop(session.sid, None)
            self.moves += 1
        session.home, session.moved_at = draft, self.clock.now
        session.pending, session.starved_since = [], None
        self._recount()
        committed = session.committed
        self._send(draft, lambda: self._opened(draft, session, committed))

    def _leave(self, session: _Session) -> None:
        if session.home is not None:
            session.home.lines.pop(session.sid, None)
            self._recount()

    def _rebalance(self) -> None:
        """duo.target.pool.pool's _move_one: the newest movable session of the first draft with a better home."""
        if not self._running():
            return
        views, now = self._views(), self.clock.now
        for view in views:
            better = better_home(view, views, self._demand())
            if better is None:
                continue
            movable = [s for s in self._running()
                       if s.home is self._draft_of(view) and now - s.moved_at >= MOVE_COOLDOWN_S]
            if movable:
                self._move(max(movable, key=lambda s: s.sid), self._draft_of(better))
                break
        self.clock.after(REBALANCE_S, self._rebalance)

    def _outcome(self) -> Outcome:
        seconds = max(s.finished_at or 0.0 for s in self.sessions)
        return Outcome(
            clients=len(self.sessions), k=self.k, seconds=seconds,
            tokens_per_second=len(self.sessions) * self.tokens / seconds,
            per_client_tokens_per_second=statistics.mean(self.tokens / (s.finished_at or seconds)
                                                         for s in self.sessions),
            tokens_per_session_step=sum(s.committed for s in self.sessions) / self.session_steps,
            starved_share=self.starved_steps / self.session_steps,
            placed=self.placed, mean_sessions={name: load / seconds for name, load in self.load_seconds.items()},
            busy={draft.spec.name: min(1.0, draft.busy_seconds / seconds) for draft in self.drafts}, moves=self.moves)


def simulate(clients: int, tokens: int, costs: dict[int, float], drafts: Sequence[DraftSpec], k: int,
             seed: int = 0) -> Outcome:
    """One run of `clients` sessions of `tokens` tokens each at draft length k (no drafts: the target alone)."""
    return _Pool(clients, tokens, costs, drafts, k, seed).run()


def mean_outcome(outcomes: list[Outcome]) -> Outcome:
    """The seeds' mean of every figure of runs at one k."""
    first = outcomes[0]
    mean = statistics.mean
    return Outcome(
        clients=first.clients, k=first.k, seconds=mean(o.seconds for o in outcomes),
        tokens_per_second=mean(o.tokens_per_second for o in outcomes),
        per_client_tokens_per_second=mean(o.per_client_tokens_per_second for o in outcomes),
        tokens_per_session_step=mean(o.tokens_per_session_step for o in outcomes),
        starved_share=mean(o.starved_share for o in outcomes), placed=first.placed,
        mean_sessions={name: mean(o.mean_sessions[name] for o in outcomes) for name in first.mean_sessions},
        busy={name: mean(o.busy[name] for o in outcomes) for name in first.busy}, moves=mean(o.moves for o in outcomes))


def best_k(clients: int, tokens: int, costs: dict[int, float], drafts: Sequence[DraftSpec],
           ks: Sequence[int] = KS, seeds: int = 4) -> Outcome:
    """The fastest fixed k of `ks`, each k's rate the mean over `seeds` runs (the same seeds for every k)."""
    by_k = [mean_outcome([simulate(clients, tokens, costs, drafts, k, seed) for seed in range(seeds)]) for k in ks]
    return max(by_k, key=lambda o: o.tokens_per_second)


def alone(clients: int, tokens: int, costs: dict[int, float]) -> Outcome:
    """The target alone: one token per running session a call (deterministic: no draft, no chance)."""
    return simulate(clients, tokens, costs, (), k=0)
