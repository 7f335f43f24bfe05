"""The draft's work: one session per target generation, drafting its chain a token at a time ahead of the commits."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol, Sequence

import numpy as np

from duo import wire
from duo._proto import duo_pb2 as pb
from duo.branches import BRANCH_SEQ, Branch, Doubt, branch_length, choose_fork, doubt_of, preferred_draft_len
from duo.model import Context, Model, ModelError
from duo.runtime import ModelWorker, timed
from duo.sampling import SamplingParams, SparseDist, coupled_ranking, distribution, sample

# DraftSession.next_work's priorities.
CHAIN_NEEDED, BRANCH, CHAIN_AHEAD = 0, 1, 2


class InvalidEvent(ValueError):
    """The target sent something a session cannot follow: a bug or a misconfiguration on its side."""


@dataclass
class DraftSession:
    """One target session as the draft sees it: the committed tokens followed by its own chain."""

    session_id: int
    chain: list[int]  # committed tokens, then drafted ones
    committed: int
    params: SamplingParams
    rng: np.random.Generator
    max_ahead: int
    p_min: float
    context: Context
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
    kv_tokens: list[int] = field(default_factory=list)  # what the KV cache holds; model thread only
    branch_kv: list[int] = field(default_factory=list)  # what sequence BRANCH_SEQ holds; model thread only

    @property
    def rejection_sampled(self) -> bool:
        """Whether the target verifies this session's tokens with their q (RESIDUAL), so they travel."""
        return not self.params.greedy and self.coupled_seed is None

    def wants_to_draft(self) -> bool:
        return (not self.paused and not self.closed and len(self.chain) - self.committed < self.max_ahead
                and len(self.chain) < self.context.n_ctx)

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


class DraftObserver(Protocol):
    """Something that watches the draft's steps (metrics)."""

    def on_step(self, seconds: float, drafted: bool) -> None: ...


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


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


def draft_one(session: DraftSession, chain: list[int]) -> tuple[int, SparseDist | None, Doubt | None] | None:
    """Draw the token after `chain` with the distribution it was drawn from (and its Doubt when the
    session drafts branches), or None where the draft is too unsure to propose one (runs on the model
    thread)."""
    logits = next_logits(session.context, session.kv_tokens, chain, seq=0)
    if not proposes(logits, session.p_min):
        return None
    return draw(session, logits, len(chain))


def next_logits(context: Context, cached: list[int], tokens: list[int], seq: int) -> np.ndarray:
    """The logits after `tokens` on sequence `seq`, which holds `cached` (updated in place): roll back
    to where the two part and decode the rest, at least the last token (for fresh logits)."""
    keep = min(common_prefix_length(cached, tokens), len(tokens) - 1)
    context.rollback(keep, seq=seq)
    del cached[keep:]
    logits = context.decode(tokens[keep:], keep, seq=seq)[-1]
    cached.extend(tokens[keep:])
    return logits


def draw(session: DraftSession, logits: np.ndarray, position: int) -> tuple[int, SparseDist | None, Doubt | None]:
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


def extend_branch(session: DraftSession, chain: list[int], fork: int,
                  tokens: list[int]) -> tuple[int, SparseDist | None, Doubt | None]:
    """Draw the token after chain[:fork] + tokens on the branch sequence (runs on the model thread).

    The branch sequence shares the chain's cached prefix up to the fork (no recompute) and keeps
    what it decoded, so growing a branch decodes one token a step, as the chain does.
    """
    want = chain[:fork] + tokens
    if common_prefix_length(session.branch_kv, want) < fork:  # it holds another branch: share the chain's prefix
        session.context.fork(BRANCH_SEQ, fork)
        session.branch_kv = want[:fork]
    return draw(session, next_logits(session.context, session.branch_kv, want, seq=BRANCH_SEQ), len(want))


class Drafter:
    """Drafts for every session of every connected target on one model, one token per step, in turns.

    Everything a target sends is checked before it reaches the model: a bad event raises InvalidEvent
    (or ModelError for what the draft cannot hold) for its session alone.
    """

    def __init__(self, model: Model, worker: ModelWorker, n_ctx: int, top_k_cap: int,
                 observer: DraftObserver | None = None, *, max_branches: int = 0, branch_len: int = 0) -> None:
        self.model = model
        self.max_branches = max_branches
        self.branch_len = branch_len
        self.worker = worker
        self.n_ctx = min(n_ctx, model.n_ctx_train)  # what a context gets (duo.model.Context caps it so)
        self.n_vocab = model.n_vocab
        self.top_k_cap = top_k_cap
        self.observer = observer

    def draft_params(self, params: SamplingParams) -> SamplingParams:
        """The session's sampling, further truncated to the draft's top-k cap (residual sessions only:
        coupled ones send no q, so their drafts come from the whole distribution).

        Any q is lossless as long as the target is told the q a token was really drawn from, and a
        narrow q keeps each message small (a full-vocabulary q is 1 MB per token). llama.cpp's
        speculative example drafts from the top 10 for the same reason.
        """
        if params.greedy:
            return params
        return replace(params, top_k=min(params.top_k or self.top_k_cap, self.top_k_cap))

    async def open(self, message: pb.OpenSession) -> DraftSession:
        """A session drafting after `message.committed`; InvalidEvent or ModelError when it cannot be."""
        params, seed, coupled = self._checked_open(message)
        n_seq = 2 if self.max_branches else 1  # the chain's sequence, and the branches'
        context = await self.worker.create(partial(self.model.new_context, n_seq=n_seq), self.n_ctx)
        return DraftSession(
            session_id=message.session_id, chain=list(message.committed), committed=len(message.committed),
            params=params if coupled else self.draft_params(params),
            rng=np.random.default_rng(None if seed is None else [seed, 1]),  # not the target's
            max_ahead=message.max_ahead, p_min=message.p_min, context=context,
            coupled_seed=seed if coupled else None, max_branches=self.max_branches, branch_len=self.branch_len)

    def _checked_open(self, message: pb.OpenSession) -> tuple[SamplingParams, int | None, bool]:
        """The session's sampling, its seed, and whether it is COUPLED (a sampled session with a seed)."""
        if not message.committed:
            raise InvalidEvent("a session needs at least one committed token (the prompt)")
        self._check_tokens(message.committed)
        if len(message.committed) >= self.n_ctx:
            raise ModelError(f"the prompt ({len(message.committed)} tokens) does not fit the draft's context "
                             f"of {self.n_ctx}; start duo-draft with a larger --ctx-size")
        if not 0 <= message.p_min <= 1:
            raise InvalidEvent(f"p_min must be between 0 and 1, got {message.p_min}")
        self._check_max_ahead(message.max_ahead)
        params, seed = wire.sampling_from_pb(message.sampling)
        try:
            params.validate()
        except ValueError as error:
            raise InvalidEvent(str(error)) from error
        if message.verification not in (pb.RESIDUAL, pb.COUPLED):
            raise InvalidEvent(f"unknown verification {message.verification} (this draft speaks {wire.PROTOCOL})")
        coupled = message.verification == pb.COUPLED and not params.greedy
        if coupled and seed is None:
            raise InvalidEvent("a COUPLED session needs sampling.seed: the noise both sides share derives from it")
        return params, seed, coupled

    def commit(self, session: DraftSession, start: int, tokens: Sequence[int]) -> None:
        """Apply the target's commit of `tokens` at positions [start, start + len(tokens))."""
        if start != session.committed:
            raise InvalidEvent(f"a commit at position {start}, but {session.committed} tokens are committed: "
                               "a commit must continue the committed sequence")
        self._check_tokens(tokens)
        if start + len(tokens) >= self.n_ctx:
            raise ModelError(f"the session outgrew the draft's context of {self.n_ctx} tokens; start duo-draft "
                             "with a larger --ctx-size")
        session.apply_commit(start, tokens)

    def steer(self, session: DraftSession, max_ahead: int) -> None:
        self._check_max_ahead(max_ahead)
        session.max_ahead = max_ahead

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_vocab):
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise InvalidEvent(f"token id {bad} is outside the draft's vocabulary of {self.n_vocab}")

    def _check_max_ahead(self, max_ahead: int) -> None:
        if max_ahead > self.n_ctx:
            raise InvalidEvent(f"max_ahead {max_ahead} is beyond the draft's whole context of {self.n_ctx}")

    async def close(self, *sessions: DraftSession) -> None:
        """Stop drafting for `sessions` and free their contexts in one model-thread call, which runs to
        its end even if the caller is cancelled meanwhile. A step already on the model thread finishes
        first: the thread runs its calls in order.
        """
        closing = [session for session in sessions if not session.closed]
        for session in closing:
            session.closed = True
        if closing:
            await self.worker.close(_Contexts([session.context for session in closing]))

    async def step(self, session: DraftSession) -> pb.DraftChunk | None:
        """Draft one token; a chunk that says the chain paused where the draft is too unsure (p_min);
        None when a commit changed the chain meanwhile."""
        chain, epoch = list(session.chain), session.epoch
        drawn, seconds = await self.worker.run(timed, draft_one, session, chain)
        if self.observer is not None:
            self.observer.on_step(seconds, drawn is not None)
        if session.closed or session.epoch != epoch or len(session.chain) != len(chain):
            return None  # drafted on a chain that a commit has just replaced
        if drawn is None:
            session.paused = True  # until the next commit moves the chain on; the target need not wait
            return pb.DraftChunk(session_id=session.session_id, epoch=epoch, start=len(chain), paused=True)
        token, dist, doubt = drawn
        session.chain.append(token)
        if doubt is not None:
            session.doubts[len(chain)] = doubt
        if self.model.is_end_of_generation(token):
            session.paused = True  # nothing follows an end of generation
        return pb.DraftChunk(session_id=session.session_id, epoch=epoch, start=len(chain), tokens=[token],
                             dists=self._dists(session, [dist]))

    async def branch(self, session: DraftSession) -> pb.DraftChunk | None:
        """Grow the session's unfinished branch by one token, or start one at the next fork; None when
        a commit came meanwhile (the branch may be moot) or there is nothing to branch."""
        growing, fork = session.planned_branch()
        if fork is None:
            return None
        assumed = growing.tokens if growing else [session.doubts[fork].alternative]
        chain, commits = list(session.chain), session.commits
        drawn, seconds = await self.worker.run(timed, extend_branch, session, chain, fork, assumed)
        if self.observer is not None:
            self.observer.on_step(seconds, True)
        if session.closed or session.commits != commits:
            return None
        token, dist, doubt = drawn
        if growing is None:
            growing = Branch(session.new_epoch(), fork, assumed, [None])
            session.branches.append(growing)
            chunk = pb.DraftChunk(session_id=session.session_id, epoch=growing.epoch, start=fork,
                                  tokens=[assumed[0], token], branch_of=session.epoch,
                                  dists=self._dists(session, [session.doubts[fork].dist, dist]))
        else:
            chunk = pb.DraftChunk(session_id=session.session_id, epoch=growing.epoch, start=growing.end,
                                  tokens=[token], dists=self._dists(session, [dist]))
        growing.tokens.append(token)
        growing.doubts.append(doubt)
        growing.finished = (len(growing.tokens) > session.current_branch_len()
                            or self.model.is_end_of_generation(token))
        return chunk

    @staticmethod
    def _dists(session: DraftSession, dists: list[SparseDist | None]) -> list[pb.SparseDist]:
        return [wire.dist_to_pb(dist) for dist in dists if dist is not None] if session.rejection_sampled else []


@dataclass(frozen=True)
class _Contexts:
    """Several contexts closed as one resource (ModelWorker.close takes one)."""

    contexts: list[Context]

    def close(self) -> None:
        for context in self.contexts:
            context.close()
