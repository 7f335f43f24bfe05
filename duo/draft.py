"""The draft's work: one session per target generation, drafting its chain a token at a time ahead of the commits."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from duo import wire
from duo._proto import duo_pb2 as pb
from duo.model import Context, Model, ModelError
from duo.runtime import ModelWorker
from duo.sampling import SamplingParams, SparseDist, distribution, sample


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
    paused: bool = False  # after a low-confidence or end-of-generation token, until the next commit
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


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def draft_one(session: DraftSession, chain: list[int], model: Model) -> tuple[int, SparseDist, float]:
    """Decode what the KV cache lacks of `chain` and draw the next token (runs on the model thread).

    Returns the token, the distribution it was drawn from, and the draft's confidence in it: its
    probability at temperature 1, which is what --draft-p-min is compared with (1.0 without a
    p_min: a softmax over the vocabulary is worth skipping on every drafted token).
    """
    keep = common_prefix_length(session.kv_tokens, chain)
    keep = min(keep, len(chain) - 1)  # at least one token must be decoded to get fresh logits
    session.context.rollback(keep)
    del session.kv_tokens[keep:]
    logits = session.context.decode(chain[keep:], keep)[-1]
    session.kv_tokens.extend(chain[keep:])
    dist = distribution(logits, session.params)
    token = sample(dist, session.rng)
    if session.p_min <= 0:
        return token, dist, 1.0
    shifted = logits.astype(np.float64) - logits.max()
    return token, dist, float(np.exp(shifted[token]) / np.exp(shifted).sum())


class Drafter:
    """Drafts for every session of every connected target on one model, one token per step, in turns."""

    def __init__(self, model: Model, worker: ModelWorker, n_ctx: int, top_k_cap: int) -> None:
        self.model = model
        self.worker = worker
        self.n_ctx = n_ctx
        self.top_k_cap = top_k_cap

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
        params, seed = wire.sampling_from_pb(message.sampling)
        committed = list(message.committed)
        if not committed:
            raise ModelError("a session needs at least one committed token (the prompt)")
        context = await self.worker.run(self.model.new_context, self.n_ctx)
        if len(committed) >= context.n_ctx:
            await self.worker.run(context.close)
            raise ModelError(f"the prompt ({len(committed)} tokens) does not fit the draft's context "
                             f"of {context.n_ctx}; start duo-draft with a larger --ctx-size")
        return DraftSession(
            session_id=message.session_id, chain=committed, committed=len(committed), params=self.draft_params(params),
            rng=np.random.default_rng(None if seed is None else [seed, 1]),  # independent of the target's
            max_ahead=message.max_ahead, p_min=message.p_min, context=context)

    async def close(self, session: DraftSession) -> None:
        session.closed = True
        await self.worker.run(session.context.close)

    async def step(self, session: DraftSession) -> pb.DraftChunk | None:
        """Draft one token; None when a commit changed the chain meanwhile or the draft lost confidence."""
        chain, epoch = list(session.chain), session.epoch
        token, dist, confidence = await self.worker.run(draft_one, session, chain, self.model)
        if session.closed or session.epoch != epoch or len(session.chain) != len(chain):
            return None  # drafted on a chain that a commit has just replaced
        if confidence < session.p_min:
            session.paused = True
            return None
        session.chain.append(token)
        if self.model.is_end_of_generation(token):
            session.paused = True  # nothing follows an end of generation
        dists = [] if session.params.greedy else [wire.dist_to_pb(dist)]
        return pb.DraftChunk(session_id=session.session_id, epoch=epoch, start=len(chain), tokens=[token],
                             dists=dists)
