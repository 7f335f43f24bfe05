"""The draft's work: a session per target generation, and rounds that draft the next token for every session at once."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Iterable, Protocol, Sequence

import numpy as np

from duo.net import wire
from duo.net._proto import duo_pb2 as pb
from duo.constraint import Compiler, CompilerBusy, Cursor, GrammarError
from duo.draft.batch import DraftCache, RoundReport, Step, Work, plan_works
from duo.draft.branches import Branch, Doubt, branch_length
from duo.draft.guess import GuessRate, guess_length, shared_guess_rate
from duo.draft.session import DraftSession, Drawn
from duo.draft.value import RoundCost, with_riders
from duo.draft.window import Window
from duo.lookup import ContextLookup
from duo.llama.model import N_BATCH, Model, ModelError
from duo.llama.parking import DEFAULT_LIMIT_MIB, parking_for
from duo.llama.worker import ModelWorker
from duo.sampling.distributions import SparseDist
from duo.sampling.ops.penalties import Penalties
from duo.sampling.params import SamplingParams

# duo-draft --kv-cells by default: room for this many sessions of up to SESSION_CELLS tokens (or of their longest,
# --ctx-size, where that is shorter), or for many more shorter ones: the cells are shared. A context as long as the
# model's (32k, duo-draft's default as llama-server's) gets room for one session at its longest, not four: four
# times the model's context would take gigabytes for sessions that agents' prompts (6-18k tokens) never fill.
KV_CELLS_PER_CONTEXT = 4
SESSION_CELLS = 8192
# How far a windowed session reaches: as far as its target lets it (the target's context bounds it).
UNBOUNDED = 1 << 62


def default_cells(n_ctx: int) -> int:
    """The KV cells the draft allocates without --kv-cells, for sessions of up to `n_ctx` positions."""
    return max(n_ctx, KV_CELLS_PER_CONTEXT * min(n_ctx, SESSION_CELLS))


class InvalidEvent(ValueError):
    """The target sent something a session cannot follow: a bug or a misconfiguration on its side."""


class DraftObserver(Protocol):
    """Something that watches the draft's rounds (metrics)."""

    def on_round(self, report: RoundReport) -> None: ...


@dataclass(frozen=True)
class Drafted:
    """What a round made for one session: a chunk to send to its target, or the error that ends the
    session alone (a SessionError); neither when a commit made its token stale, or its catch-up goes on."""

    session: DraftSession
    chunk: pb.DraftChunk | None = None
    error: Exception | None = None


class Drafter:
    """Drafts for every session of every connected target on one model. All sessions live in one llama
    context (DraftCache), and each round drafts the next token of every session that has work in one
    batched decode: the weights are read once per round, not once per session.

    Everything a target sends is checked before it reaches the model: a bad event raises InvalidEvent
    (or ModelError for what the draft cannot hold) for its session alone.
    """

    def __init__(self, model: Model, worker: ModelWorker, n_ctx: int, top_k_cap: int,
                 observer: DraftObserver | None = None, *, max_branches: int = 0, branch_len: int = 0,
                 max_sessions: int = 16, cells: int | None = None, flash_attn: bool | None = None,
                 window: Window = Window(), cache_ram: int = DEFAULT_LIMIT_MIB) -> None:
        """`n_ctx`: positions per session; `cells`: KV cells shared by all sessions (default default_cells(n_ctx));
        `max_sessions`: the slots of sequences in the cache; `flash_attn`: llama.cpp's flash attention on or off
        (None: its own choice); `window`: how much of each session the KV holds (duo.draft.window; its size 0: all of
        it, up to n_ctx positions). With a window shorter than n_ctx a session reaches as far as its target lets it,
        and a sequence holds window.cells positions and a batch of guessed or branch tokens after them. `cache_ram`:
        MiB of host memory where closed sessions' chains wait for their next turn (duo.llama.parking.parking_for)."""
        self.model = model
        self.max_branches = max_branches
        self.branch_len = branch_len
        self.worker = worker
        n_ctx = min(n_ctx, model.n_ctx_train)
        # A window no shorter than the context buys nothing: sessions then reach n_ctx, as without one.
        self.window = window if window.size and window.cells + N_BATCH < n_ctx else Window()
        self.n_ctx = self.window.cells + N_BATCH if self.window.size else n_ctx  # what a sequence gets
        self.reach = UNBOUNDED if window.size else self.n_ctx  # the positions a session may reach
        self.cells = max(cells or default_cells(self.n_ctx), self.n_ctx)  # as duo.llama.context.Context makes it
        self.max_sessions = max_sessions
        self.flash_attn = flash_attn
        self.cache_ram = cache_ram
        self.n_vocab = model.n_vocab
        self.top_k_cap = top_k_cap
        self.observer = observer
        self.round_cost = RoundCost()
        self.guess_rate = shared_guess_rate()  # how often draws follow the context's guess, over all sessions
        self.compiler = Compiler()  # the sessions' grammars, each within its budget
        self.cache: DraftCache | None = None
        self._making: asyncio.Future[DraftCache] | None = None

    @property
    def cells_used(self) -> int:
        return self.cache.cells_used if self.cache else 0

    @property
    def slots_free(self) -> int:
        return len(self.cache.free) if self.cache else self.max_sessions

    async def start(self) -> None:
        """Make the shared cache on the model thread, once; later calls wait for the same one. A caller
        cancelled meanwhile does not cancel the making: the cache is the drafter's, not a session's."""
        if self._making is None:
            self._making = asyncio.ensure_future(self.worker.create(self._new_cache))
        self.cache = await asyncio.shield(self._making)

    def _new_cache(self) -> DraftCache:
        per_session = 2 if self.max_branches else 1  # the chain's sequence, and the branches'
        context = self.model.new_context(self.n_ctx, n_seq=self.max_sessions * per_session, cells=self.cells,
                                         flash_attn=self.flash_attn)
        return DraftCache(context, self.cells, self.max_sessions, branches=bool(self.max_branches),
                          parking=parking_for(context, self.cache_ram))

    async def stop(self) -> None:
        """Free the shared cache (once every session is closed), even one still being made."""
        if self._making is None:
            return
        making, self._making, self.cache = self._making, None, None
        try:
            cache = await making
        except ModelError:
            return  # never made
        await self.worker.close(cache)

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
        # Off the event loop: the prompt's ids and the biases are checked one by one, and DRY's restart sequences
        # are found in the draft's own vocabulary (the first time for its breakers, a walk of it).
        params, seed, coupled, penalties = await asyncio.to_thread(self._checked_open, message)
        cursor = await self._grammar_cursor(message)
        lookup = ContextLookup(list(message.committed)) if message.lookup else None
        if lookup is not None:  # the prompt indexed before a slot is taken: a cancelled open then holds none
            await lookup.index_off_loop()
        await self.start()
        slot = self.cache.take_slot()
        return DraftSession(
            session_id=message.session_id, chain=list(message.committed), committed=len(message.committed),
            params=params if coupled else self.draft_params(params),
            rng=np.random.default_rng(None if seed is None else [seed, 1]),  # not the target's
            max_ahead=message.max_ahead, p_min=message.p_min, slot=slot, n_ctx=self.reach, window=self.window,
            coupled_seed=seed if coupled else None, max_branches=self.max_branches, branch_len=self.branch_len,
            cursor=cursor, output_start=message.output_start, penalties=penalties, lookup=lookup,
            guess_rate=GuessRate(self.guess_rate), committed_mu=_opening_mu(message, params))

    async def _grammar_cursor(self, message: pb.OpenSession) -> Cursor | None:
        """The session's grammar compiled for the draft's vocabulary within its budget, on a thread of its own
        (duo.constraint.Compiler: the first mask too, which would otherwise stall the model thread every session
        shares), so that it drafts inside it; None for free text."""
        if not message.grammar:
            return None
        try:
            return await self.compiler.compile(self.model, message.grammar)
        except (GrammarError, CompilerBusy) as error:
            raise InvalidEvent(f"the session's grammar cannot be drafted with: {error}") from error

    def _checked_open(self, message: pb.OpenSession) -> tuple[SamplingParams, int | None, bool, Penalties]:
        """The session's sampling, its seed, whether it is COUPLED (a sampled session with a seed), and its
        penalties for the draft's vocabulary."""
        if not message.committed:
            raise InvalidEvent("a session needs at least one committed token (the prompt)")
        self._check_tokens(message.committed)
        if len(message.committed) >= self.reach:
            raise ModelError(f"the prompt ({len(message.committed)} tokens) does not fit the draft's context "
                             f"of {self.n_ctx}; start duo-draft with a larger --ctx-size")
        if not 0 <= message.p_min <= 1:
            raise InvalidEvent(f"p_min must be between 0 and 1, got {message.p_min}")
        self._check_max_ahead(message.max_ahead)
        if message.output_start > len(message.committed):
            raise InvalidEvent(f"output_start {message.output_start} is beyond the {len(message.committed)} "
                               "committed tokens")
        params, seed = wire.sampling_from_pb(message.sampling, self.model)
        penalties = wire.penalties_from_pb(message.sampling)
        try:
            params.validate()
            penalties.validate(self.n_vocab)
        except ValueError as error:
            raise InvalidEvent(str(error)) from error
        if message.verification not in (pb.RESIDUAL, pb.COUPLED):
            raise InvalidEvent(f"unknown verification {message.verification} (this draft speaks {wire.PROTOCOL})")
        coupled = message.verification == pb.COUPLED and not params.greedy
        if coupled and seed is None:
            raise InvalidEvent("a COUPLED session needs sampling.seed: the noise both sides share derives from it")
        return params, seed, coupled, penalties.for_vocab(self.model)

    def commit(self, session: DraftSession, start: int, tokens: Sequence[int], mu: float | None = None) -> None:
        """Apply the target's commit of `tokens` at positions [start, start + len(tokens)), after which its mirostat
        state is `mu` (None: unchanged, or none)."""
        if start != session.committed:
            raise InvalidEvent(f"a commit at position {start}, but {session.committed} tokens are committed: "
                               "a commit must continue the committed sequence")
        self._check_tokens(tokens)
        if start + len(tokens) >= self.reach:
            raise ModelError(f"the session outgrew the draft's context of {self.n_ctx} tokens; start duo-draft "
                             "with a larger --ctx-size")
        session.apply_commit(start, tokens, _checked_mu(mu) if session.params.mirostat else None)

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
        if self.window.size and max_ahead > self.window.grid:
            # A chain ahead of its commits by more than half a window would fork branches the window dropped.
            raise InvalidEvent(f"max_ahead {max_ahead} is beyond half the draft's window ({self.window.grid}); "
                               "start duo-draft with a larger --window")

    async def close(self, *sessions: DraftSession) -> None:
        """Stop drafting for `sessions` and free their sequences in one model-thread call, which runs to
        its end even if the caller is cancelled meanwhile. A round already on the model thread finishes
        first: the thread runs its calls in order.
        """
        closing = [session for session in sessions if not session.closed]
        for session in closing:
            session.closed = True
            self.cache.give_back(session.slot)
        if closing:
            await self.worker.close(_Release(self.cache, closing))

    async def draft_round(self, sessions: Iterable[DraftSession]) -> list[Drafted]:
        """One batched model call drafting the next tokens of work (DraftSession.offered_rounds) of each of
        `sessions` that has any, and what came of each; [] when none has work. Never raises: a call that
        fails as a whole (the model broke) fails each of its sessions."""
        offering = [(session, offer) for session in sessions if (offer := session.offered_rounds())]
        chosen = with_riders([offer for _, offer in offering], self.round_cost)
        works = self._with_guesses([work for (session, _), rounds in zip(offering, chosen)
                                    for work in plan_works(session, rounds)])
        if not works:
            return []
        try:
            steps, report = await self.worker.run(self.cache.run, works)
        except Exception as error:  # whatever it is, the sessions go on without the draft, the stream does not end
            return [Drafted(work.session, error=error) for work in works]
        self.round_cost.observe(report.tokens, report.seconds)
        if self.observer is not None:
            self.observer.on_round(report)
        return [self._finish(work, step) for work, step in zip(works, steps)]

    def _with_guesses(self, works: list[Work]) -> list[Work]:
        """Each chain work with the context's guess of its next tokens (duo.draft.guess), as long as it pays: guessed
        tokens stay within the session's max_ahead and context, and end before any end of generation."""
        tokens = len(works)  # a work counts as one token, as with_riders counts it (a catch-up decodes a few more)
        guessing = []
        for work in works:
            session = work.session
            if work.fork is None and session.lookup is not None:
                room = min(session.max_ahead - (len(work.tokens) - session.committed), session.n_ctx - len(work.tokens))
                proposal = session.guess(room - 1)  # the draw after the guess takes a place too
                ends = [i for i, token in enumerate(proposal) if self.model.is_end_of_generation(token)]
                proposal = proposal[:ends[0]] if ends else proposal
                length = guess_length(session.guess_rate.own.value, self.round_cost, tokens, len(proposal))
                if length:
                    work, tokens = replace(work, guess=tuple(proposal[:length])), tokens + length
            guessing.append(work)
        return guessing

    def _finish(self, work: Work, step: Step) -> Drafted:
        if step.error is not None:
            return Drafted(work.session, error=step.error)
        if step.guessed:
            work.session.guess_rate.judge(step.kept, step.missed)
        chunk = self._chain_chunk(work, step) if work.fork is None else self._branch_chunk(work, step)
        return Drafted(work.session, chunk)

    def _chain_chunk(self, work: Work, step: Step) -> pb.DraftChunk | None:
        """Append the drawn tokens to the chain and return their chunk, or one that says the chain paused
        where the draft is too unsure (p_min); None when a commit changed the chain meanwhile."""
        session, start = work.session, work.chain_len
        if session.closed or session.epoch != work.epoch or len(session.chain) != start:
            return None  # drafted on a chain that a commit has just replaced
        if step.paused:
            session.paused = True  # until the next commit moves the chain on; the target need not wait
            return pb.DraftChunk(session_id=session.session_id, epoch=work.epoch, start=start, paused=True)
        if not step.drawn:
            return None  # its catch-up goes on next round
        drawn = self._extend_chain(session, start, step.drawn)
        return pb.DraftChunk(session_id=session.session_id, epoch=work.epoch, start=start,
                             tokens=[token for token, _, _ in drawn],
                             dists=self._dists(session, [dist for _, dist, _ in drawn]),
                             confidence=step.confidences[:len(drawn)])

    def _extend_chain(self, session: DraftSession, start: int, drawn: Sequence[Drawn]) -> Sequence[Drawn]:
        """Append `drawn` to the chain at `start`, up to an end of generation (nothing follows it: the chain pauses),
        and return what was appended."""
        for i, (token, _, doubt) in enumerate(drawn):
            session.chain.append(token)
            if doubt is not None:
                session.doubts[start + i] = doubt
            if self.model.is_end_of_generation(token):
                session.paused = True
                return drawn[:i + 1]
        return drawn

    def _branch_chunk(self, work: Work, step: Step) -> pb.DraftChunk | None:
        """Grow the session's branch by the drawn token (starting it, at work.fork, if new) and return
        its chunk; None when a commit meanwhile made the round moot.

        A commit does not make every branch round stale: one that agreed with the chain leaves a branch
        forking at an undecided position as valid as before, and one that took the growing branch makes
        the drawn token the new chain's next (draft rounds are the scarce resource: none is thrown away
        that still holds)."""
        session, growing = work.session, work.growing
        if session.closed or not step.drawn:
            return None
        token, dist, doubt = step.drawn[0]  # a branch's work guesses nothing: one token
        confidence = step.confidences[:1]
        if growing is not None and session.epoch == growing.epoch:
            return self._taken_branch_chunk(session, growing, token, dist, doubt, confidence)
        if not self._branch_round_holds(session, work):
            return None
        if growing is None:
            assumed = work.tokens[work.fork:]
            growing = Branch(session.new_epoch(), work.fork, assumed, [None])
            session.branches.append(growing)
            chunk = pb.DraftChunk(session_id=session.session_id, epoch=growing.epoch, start=work.fork,
                                  tokens=[assumed[0], token], branch_of=session.epoch,
                                  dists=self._dists(session, [work.doubt.dist, dist]),
                                  confidence=[0.0, *confidence] if confidence else [])  # [0]: never verified
        else:
            chunk = pb.DraftChunk(session_id=session.session_id, epoch=growing.epoch, start=growing.end,
                                  tokens=[token], dists=self._dists(session, [dist]), confidence=confidence)
        growing.tokens.append(token)
        growing.doubts.append(doubt)
        growing.finished = (len(growing.tokens) > branch_length(session.max_ahead, session.branch_len)
                            or self.model.is_end_of_generation(token))
        return chunk

    @staticmethod
    def _branch_round_holds(session: DraftSession, work: Work) -> bool:
        """Whether a branch round still applies: no commit came, or the ones that came kept the chain it
        forks from (same epoch: the chain before the fork is unchanged) and left its fork undecided."""
        if session.commits == work.commits:
            return True
        if session.epoch != work.epoch or work.fork < session.committed:
            return False
        if work.growing is not None:
            return work.growing in session.branches and work.growing.end == len(work.tokens)
        return (len(session.branches) < session.max_branches
                and all(branch.fork != work.fork for branch in session.branches))

    def _taken_branch_chunk(self, session: DraftSession, taken: Branch, token: int, dist: SparseDist | None,
                            doubt: Doubt | None, confidence: Sequence[float]) -> pb.DraftChunk | None:
        """The target took the branch this round grew as its chain: the token continues the chain, if
        the chain still ends where the branch did (no later commit moved it)."""
        start = taken.fork + len(taken.tokens)
        if len(session.chain) != start or session.paused or start >= session.n_ctx:
            return None
        session.chain.append(token)
        if doubt is not None:
            session.doubts[start] = doubt
        if self.model.is_end_of_generation(token):
            session.paused = True
        return pb.DraftChunk(session_id=session.session_id, epoch=session.epoch, start=start, tokens=[token],
                             dists=self._dists(session, [dist]), confidence=confidence)

    @staticmethod
    def _dists(session: DraftSession, dists: list[SparseDist | None]) -> list[pb.SparseDist]:
        return [wire.dist_to_pb(dist) for dist in dists if dist is not None] if session.rejection_sampled else []


@dataclass(frozen=True)
class _Release:
    """Closed sessions' sequences, freed as one resource (ModelWorker.close takes one)."""

    cache: DraftCache
    sessions: list[DraftSession]

    def close(self) -> None:
        for session in self.sessions:
            self.cache.release(session)


def _opening_mu(message: pb.OpenSession, params: SamplingParams) -> float | None:
    """Mirostat's state after the committed tokens as the session opens: the target's, or its start (2 tau)."""
    if not params.mirostat:
        return None
    mu = _checked_mu(wire.mu_from_pb(message))
    return params.start_mu() if mu is None else mu


def _checked_mu(mu: float | None) -> float | None:
    """A mirostat state from the target: a finite number (None: the target sent none; the draft keeps its own)."""
    if mu is not None and not np.isfinite(mu):
        raise InvalidEvent(f"mirostat_mu must be a finite number, got {mu}")
    return mu
