"""The draft's work: one session per target generation, drafting its chain a token at a time ahead of the commits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence, TypeVar

import numpy as np

from duo import wire
from duo._proto import duo_pb2 as pb
from duo.model import Context, Model, ModelError
from duo.runtime import ModelWorker
from duo.sampling import SamplingParams, SparseDist, distribution, sample

T = TypeVar("T")


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
    epoch: int = 0
    paused: bool = False  # after a doubtful position (p_min) or an end of generation, until the next commit
    closed: bool = False
    kv_tokens: list[int] = field(default_factory=list)  # what the KV cache holds; model thread only

    def wants_to_draft(self) -> bool:
        return (not self.paused and not self.closed and len(self.chain) - self.committed < self.max_ahead
                and len(self.chain) < self.context.n_ctx)

    def apply_commit(self, start: int, tokens: Sequence[int]) -> None:
        """Keep the chain where the target agreed with it, else restart it (a new epoch) from the commit."""
        end = start + len(tokens)
        if self.chain[start:end] != list(tokens):
            # The commit contradicted the chain or ran past it: restart from the committed sequence.
            # Its KV entries stay where they match; the next step rolls the cache back to the fork.
            self.chain = self.chain[:start] + list(tokens)
            self.epoch += 1
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


def draft_one(session: DraftSession, chain: list[int]) -> tuple[int, SparseDist] | None:
    """Decode what the KV cache lacks of `chain` and draw the next token with the distribution it was
    drawn from, or None where the draft is too unsure to propose one (runs on the model thread)."""
    keep = common_prefix_length(session.kv_tokens, chain)
    keep = min(keep, len(chain) - 1)  # at least one token must be decoded to get fresh logits
    session.context.rollback(keep)
    del session.kv_tokens[keep:]
    logits = session.context.decode(chain[keep:], keep)[-1]
    session.kv_tokens.extend(chain[keep:])
    if not proposes(logits, session.p_min):
        return None
    dist = distribution(logits, session.params)
    return sample(dist, session.rng), dist


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """fn(*args) and the seconds it took (called on the model thread, so no waiting is counted)."""
    began = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - began


class Drafter:
    """Drafts for every session of every connected target on one model, one token per step, in turns.

    Everything a target sends is checked before it reaches the model: a bad event raises InvalidEvent
    (or ModelError for what the draft cannot hold) for its session alone.
    """

    def __init__(self, model: Model, worker: ModelWorker, n_ctx: int, top_k_cap: int,
                 observer: DraftObserver | None = None) -> None:
        self.model = model
        self.worker = worker
        self.n_ctx = min(n_ctx, model.n_ctx_train)  # what a context gets (duo.model.Context caps it so)
        self.n_vocab = model.n_vocab
        self.top_k_cap = top_k_cap
        self.observer = observer

    def draft_params(self, params: SamplingParams) -> SamplingParams:
        """The session's sampling, further truncated to the draft's top-k cap.

        Any q is lossless as long as the target is told the q a token was really drawn from, and a
        narrow q keeps each message small (a full-vocabulary q is 1 MB per token). llama.cpp's
        speculative example drafts from the top 10 for the same reason.
        """
        if params.greedy:
            return params
        return replace(params, top_k=min(params.top_k or self.top_k_cap, self.top_k_cap))

    async def open(self, message: pb.OpenSession) -> DraftSession:
        """A session drafting after `message.committed`; InvalidEvent or ModelError when it cannot be."""
        params, seed = self._checked_open(message)
        context = await self.worker.create(self.model.new_context, self.n_ctx)
        return DraftSession(
            session_id=message.session_id, chain=list(message.committed), committed=len(message.committed),
            params=params, rng=np.random.default_rng(None if seed is None else [seed, 1]),  # not the target's
            max_ahead=message.max_ahead, p_min=message.p_min, context=context)

    def _checked_open(self, message: pb.OpenSession) -> tuple[SamplingParams, int | None]:
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
        return self.draft_params(params), seed

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
        """Draft one token; None when a commit changed the chain meanwhile or the draft is too unsure."""
        chain, epoch = list(session.chain), session.epoch
        drawn, seconds = await self.worker.run(timed, draft_one, session, chain)
        if self.observer is not None:
            self.observer.on_step(seconds, drawn is not None)
        if session.closed or session.epoch != epoch or len(session.chain) != len(chain):
            return None  # drafted on a chain that a commit has just replaced
        if drawn is None:
            session.paused = True  # until the next commit moves the chain on
            return None
        token, dist = drawn
        session.chain.append(token)
        if self.model.is_end_of_generation(token):
            session.paused = True  # nothing follows an end of generation
        dists = [] if session.params.greedy else [wire.dist_to_pb(dist)]
        return pb.DraftChunk(session_id=session.session_id, epoch=epoch, start=len(chain), tokens=[token],
                             dists=dists)


@dataclass(frozen=True)
class _Contexts:
    """Several contexts closed as one resource (ModelWorker.close takes one)."""

    contexts: list[Context]

    def close(self) -> None:
        for context in self.contexts:
            context.close()
