"""The target's generation loop: each step verifies in one batch whatever chain tokens the draft sent."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from functools import partial
from typing import AsyncIterator, Callable, Protocol

import numpy as np

from duo import wire
from duo._proto import duo_pb2 as pb
from duo.costs import StepCosts
from duo.lookup import ContextLookup
from duo.model import Model, ModelError
from duo.runtime import ModelWorker, within
from duo.sampling.distributions import SparseDist
from duo.sampling.ops.penalties import OutputCounts
from duo.sampling.verification import COUPLED, GREEDY, RESIDUAL, Verdict
from duo.target.batching import CallObserver, PrefillWork, StepBatcher, VerifyWork, one_token_seconds
from duo.target.chain import DraftChain
from duo.target.link import DraftLink
from duo.target.lookup_policy import LookupRecord
from duo.target.policy import Acceptance, AdaptivePolicy, DraftTiming
from duo.target.request import GenerationStats, Request, SpecSettings, Step, StepRecord, verification_of
from duo.target.switch import Switch
from duo.wire import ChainChunk

log = logging.getLogger("duo.target")

# A waiting step gives up this much later than the drafts were expected: WAIT_SLACK x expected + WAIT_SLACK_S.
WAIT_SLACK = 1.25
WAIT_SLACK_S = 0.002
# Chunks that arrive closer together than this were sent apart but delivered together (the stream
# coalesces writes): their gap says nothing of the draft's pace.
COALESCED_S = 0.0005
# The synchronous mode gives up waiting for drafts after this long (a draft that stalled) and
# verifies what it has; a draft that paused (p_min) says so and is not waited for.
SYNC_WAIT_S = 1.0


class StepObserver(Protocol):
    """Something that watches the target's steps (metrics)."""

    def on_step(self, record: StepRecord) -> None: ...


class Generation:
    """One request on the target: the committed sequence grows by whatever each verify step accepts."""

    def __init__(self, session_id: int, request: Request, model: Model, settings: SpecSettings,
                 timing: DraftTiming | None = None) -> None:
        self.session_id = session_id
        self.request = request
        self.model = model
        self.settings = settings
        self.committed = list(request.prompt_tokens)
        self.chain = DraftChain(self.committed)
        self.verification = verification_of(request, settings.unseeded)
        # Coupled: the output is a function of this seed; residual: it seeds the target's own numbers.
        self.seed = request.seed if request.seed is not None else secrets.randbits(63)
        self.rng = np.random.default_rng(self.seed)
        self.stats = GenerationStats(prompt_tokens=len(request.prompt_tokens), arrived=request.arrived,
                                     verification=self.verification,
                                     seed=0 if self.verification == GREEDY else self.seed)
        self.max_ahead = settings.max_ahead  # as last told to the draft
        self.policy: AdaptivePolicy | None = None  # this request's adaptive draft length, if adaptive
        self.chunk_arrived = asyncio.Event()  # set when chain tokens arrive (waiting steps wait on it)
        # How soon drafts come back after a commit, measured here for the waiting policy.
        self.timing = timing or DraftTiming()
        self.starved_since: float | None = None  # when a commit left this session without drafts
        self.last_commit_at = 0.0
        self.last_chunk_at = 0.0
        self.draft_silent = False  # a wait found nothing: wait no more until the draft sends again
        self.draft_refused = False  # the draft ended this session (SessionError) until it is opened again
        self.told = len(self.committed)  # committed tokens the draft has been sent (the open carries the prompt)
        self.cursor = request.constraint  # the output's grammar, walked along what is verified (duo.constraint)
        self.lookup = ContextLookup(self.committed) if settings.lookup else None
        self.split = (0, 0, 0)  # this step's drafts: from the model's chain, forced by the grammar, from the lookup
        # What the penalties count: the output's tokens, kept up at each commit (duo.sampling.ops.penalties).
        self.output_counts = OutputCounts(model.n_vocab) if request.penalties.active else None
        self.mu = request.params.start_mu()  # mirostat's state after the committed tokens (duo.sampling.ops.mirostat)

    # The draft link calls these.
    def open_message(self) -> pb.OpenSession:
        self.chain.reset()  # a (re)connected draft starts its epochs afresh
        self.draft_refused = False
        self.told = len(self.committed)
        return pb.OpenSession(session_id=self.session_id, committed=self.committed,
                              sampling=wire.sampling_to_pb(self.request.params, self.seed, self.request.penalties),
                              max_ahead=self.max_ahead, p_min=self.settings.draft_p_min,
                              verification=pb.COUPLED if self.verification == COUPLED else pb.RESIDUAL,
                              grammar=self.request.grammar, output_start=len(self.request.prompt_tokens),
                              lookup=self.settings.lookup, mirostat_mu=self.mu)

    def on_chunk(self, chunk: ChainChunk) -> None:
        """Chain tokens the link has checked against this session's bounds."""
        self.chain.receive(chunk.epoch, chunk.start, chunk.tokens, chunk.dists, chunk.branch_of, chunk.paused)
        self.stats.draft_tokens_received = self.chain.received
        self.stats.branch_hits = self.chain.branch_hits
        if chunk.tokens and chunk.epoch == self.chain.epoch and chunk.branch_of is None:  # the draft's pace
            self._time_chunk(len(chunk.tokens))
        self.draft_silent = False
        self.chunk_arrived.set()

    def _time_chunk(self, n_tokens: int) -> None:
        """Learn the draft's latency after a commit that starved this session, and its pace per token
        while it drafts without a commit in between (so that no rest is counted)."""
        now = time.monotonic()
        if self.starved_since is not None and self.chain.has_pending():
            self.timing.latency.add(now - self.starved_since)
            self.starved_since = None
        elif self.last_chunk_at > self.last_commit_at and n_tokens and now - self.last_chunk_at > COALESCED_S:
            self.timing.per_token.add((now - self.last_chunk_at) / n_tokens)
        self.last_chunk_at = now

    def on_draft_lost(self) -> None:
        self.chain.reset()

    def on_draft_refused(self) -> None:
        """The draft will send nothing more for this session: no step waits for it."""
        self.draft_refused = True
        self.chunk_arrived.set()

    async def wait_for_drafts(self, enough: Callable[[list[int]], bool], seconds: float) -> None:
        """Wait until enough(pending drafts) holds or `seconds` have passed, checking at each chunk."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not enough(self.chain.pending()[0]):
            self.chunk_arrived.clear()
            try:
                await within(self.chunk_arrived.wait(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                return

    async def verify_work(self, seq: int, room: int, policy: AdaptivePolicy | None) -> VerifyWork:
        """This step's work for the batched call: the pending drafts it may verify (`room`: positions
        the context has left; the batch never runs past it), the model's chain first, then free drafts.
        Under a grammar the drafts are checked on a worker thread: llguidance's calls can take a while, and some
        hold the GIL, so none runs on the event loop."""
        pending, dists = self.chain.pending()
        if policy is not None and not policy.switch.speculating:
            pending, dists = [], []  # the draft rests: its chain waits, free drafts may still pay
        if self.verification == RESIDUAL and None in dists:
            pending = pending[:dists.index(None)]  # rejection sampling needs the q each token came from
        # k drafts in the batch commit k + 1 tokens at most: the context must hold them all.
        limit = max(0, min(self.settings.draft_max, room - 2))
        if self.cursor is None:
            pending, forced, found = self._drafts(pending, limit)
            masks = None
        else:  # the grammar looks at the tokens generated so far
            output = self.committed[len(self.request.prompt_tokens):]
            pending, forced, found, masks = await asyncio.to_thread(self._constrained_drafts, pending, output, limit)
        free = forced + found
        self.split = (len(pending), len(forced), len(found))
        dists = dists[:len(pending)] + [SparseDist.point(token) for token in free]
        if policy is not None:
            policy.free_from = len(pending) if free else None
            policy.lookup_from = len(pending) + len(forced) if found else None
        pending = pending + free
        return VerifyWork(seq=seq, pos=len(self.committed) - 1, last=self.committed[-1], pending=pending,
                          dists=dists, limit=min(len(pending), limit), draft_min=self.settings.draft_min,
                          policy=policy,
                          params=self.request.params, rng=self.rng,
                          coupled_seed=self.seed if self.verification == COUPLED else None,
                          masks=masks, penalties=self.request.penalties, counted=self.output_counts,
                          logprobs=self.request.logprobs, committed=self.committed, mu=self.mu)

    def _drafts(self, pending: list[int], limit: int) -> tuple[list[int], list[int], list[int]]:
        """The chain's drafts and the free drafts after them (_free_drafts)."""
        # Drafts past the batch's `limit` still count: the batch's last row checks the first of them.
        forced, found = self._free_drafts(pending, limit + 1) if len(pending) <= limit else ([], [])
        return pending, forced, found

    def _constrained_drafts(self, pending: list[int], output: list[int],
                            limit: int) -> tuple[list[int], list[int], list[int], list[np.ndarray]]:
        """Under the grammar, on a worker thread: the chain's drafts it allows (a draft it forbids would be rejected:
        no verify row is spent on it, nor on what follows), the free drafts after them, and the masks of the rows
        the batch may verify, so that the model thread every request shares computes none."""
        self.cursor.move_to(output)
        first = self.cursor.allowed()  # first: it builds the lexer states forced() needs without the GIL
        pending, forced, found = self._drafts(pending[:self.cursor.valid_prefix(pending)], limit)
        return pending, forced, found, [first, *self.cursor.masks_after(output, (pending + forced + found)[:limit])]

    def _free_drafts(self, pending: list[int], limit: int) -> tuple[list[int], list[int]]:
        """Drafts that cost no drafting, proposed with certainty (q = 1: residual verification accepts one with
        probability p(x), else samples p without it; another tokenization of the same text stays allowed, so the
        target may still say otherwise): where the model's chain is empty, the text the grammar forces (`{"name":
        "` of a schema); after the chain, what the context lookup finds (duo.lookup). Both, at most `limit`
        drafts in all with `pending`."""
        forced = (self.cursor.forced() if self.cursor is not None and not pending else [])[:limit - len(pending)]
        before = pending + forced
        found = self.lookup.propose(before, limit - len(before)) if self.lookup else []
        if self.cursor is not None and found:
            found = found[:self.cursor.valid_prefix(before + found) - len(before)]
        return forced, found

    def commit(self, verdict: Verdict, n_verified: int, batch_size: int) -> Step:
        """Append the verdict's tokens, stopping at an end of generation or the token limit."""
        tokens, finish = [], None
        for token in verdict.tokens:
            if self.model.is_end_of_generation(token):
                finish = "stop"
                break
            tokens.append(token)
            if self.request.max_tokens and self.stats.generated_tokens + len(tokens) >= self.request.max_tokens:
                finish = "length"
                break
        self.committed.extend(tokens)
        self.mu = verdict.mu  # what the verdict's tokens left (a stop cut short ends the request)
        if self.output_counts is not None:
            self.output_counts.extend(tokens)
        self.chain.on_commit()
        self.last_commit_at = time.monotonic()
        self.starved_since = None if self.chain.has_pending() else self.last_commit_at
        self.stats.branch_hits = self.chain.branch_hits
        self.stats.generated_tokens += len(tokens)
        self.stats.verify_steps += 1
        sizes = self.stats.batch_sizes
        sizes.extend([0] * (batch_size + 1 - len(sizes)))
        sizes[batch_size] += 1
        self.stats.draft_tokens_verified += n_verified
        self.stats.draft_tokens_accepted += min(verdict.n_accepted, len(tokens))
        chain, forced, found = self.split  # the lookup's drafts follow the chain's and the forced ones
        before = chain + forced
        self.stats.lookup_tokens_verified += max(0, min(n_verified, before + found) - before)
        self.stats.lookup_tokens_accepted += max(0, min(verdict.n_accepted, len(tokens), before + found) - before)
        self.stats.draft_rejections += verdict.n_accepted < n_verified
        return Step(tokens, finish, verdict.logprobs[:len(tokens)] if verdict.logprobs is not None else None)


class Target:
    """The target model and its draft link: runs every generation's steps, each step of all of them
    in one batched model call (duo.target.batching)."""

    def __init__(self, model: Model, worker: ModelWorker, link: DraftLink | None, *, n_ctx: int,
                 settings: SpecSettings, parallel: int = 1, prompt_cache: bool = True) -> None:
        self.model = model
        self.worker = worker
        self.link = link
        self.n_ctx = n_ctx
        self.parallel = parallel  # generations at once: one sequence each in the shared context
        self.prompt_cache = prompt_cache  # requests may start from prompt prefixes others left
        self.settings = settings
        # The adaptive policy: step costs shared by all requests (one model, one machine, measured per
        # call by its tokens), acceptance learnt per request, each starting from the estimate of its
        # verification mode (they accept differently: greedy, coupled, residual).
        self.costs = StepCosts()
        self.acceptance_by_mode = {mode: Acceptance.prior(settings.draft_max) for mode in (GREEDY, COUPLED, RESIDUAL)}
        self.free_acceptance_by_mode = {mode: Acceptance.prior(settings.draft_max)
                                        for mode in (GREEDY, COUPLED, RESIDUAL)}
        self.lookup_by_mode = {mode: LookupRecord() for mode in (GREEDY, COUPLED, RESIDUAL)}  # whether its rows pay
        # Whether speculation pays here, by what it delivers (duo.target.switch).
        self.switch = Switch()
        self.draft_len = settings.draft_max  # the latest request's preferred draft length (metrics)
        self.draft_timing = DraftTiming()  # one draft serves every request
        self.observers: list[StepObserver] = []
        self.call_observers: list[CallObserver] = []  # given to the batcher
        self._ids = itertools.count(1)
        self._batcher: StepBatcher | None = None
        self._creating = asyncio.Lock()

    async def batcher(self) -> StepBatcher:
        """The shared context and its batcher, made on first use: one sequence of n_ctx positions for
        each of `parallel` generations, in one cache of n_ctx x parallel cells."""
        async with self._creating:
            if self._batcher is None:
                n_ctx = min(self.n_ctx, self.model.n_ctx_train)
                context = await self.worker.create(partial(self.model.new_context, n_seq=self.parallel,
                                                           cells=n_ctx * self.parallel), n_ctx)
                self._batcher = StepBatcher(self.worker, context, self.costs, lambda: self.switch.speculating)
                self._batcher.observers = self.call_observers
                # The switch's first reference, timed before the draft works: the first request needs no rest.
                alone = await self.worker.run(one_token_seconds, context)
                self.switch.rest_rates.setdefault(1, 1.0 / alone)
                # T(1) for the cost model too: where the lookup proposes at every step, no step may decode alone to
                # time it, and one extrapolated from longer calls' times is far too high (the lookup then never rests).
                self.costs.observe(1, alone)
                self.switch.estimate_alone = self._estimate_alone
        return self._batcher

    async def close(self) -> None:
        """Free the shared context (no generation may be running)."""
        if self._batcher is not None:
            await self.worker.close(self._batcher.context)
            self._batcher = None

    def _estimate_alone(self, load: int) -> float | None:
        """Tokens per second a request decodes alone at `load` requests, from the calls timed so far: one token
        each, `load` tokens a call (a call's cost follows its tokens: S(m) = T(m) within a few % on a CPU)."""
        return 1.0 / self.costs.batch_seconds(load) if self.costs.timed else None

    async def generate(self, request: Request) -> AsyncIterator[tuple[Step, GenerationStats]]:
        """Yield the committed tokens step by step; the draft only ever changes the speed."""
        if not request.prompt_tokens:
            raise ModelError("the prompt is empty")
        generation = Generation(next(self._ids), request, self.model, self.settings, self.draft_timing)
        if self.settings.adaptive:
            mode = generation.verification
            generation.policy = AdaptivePolicy(self.settings.draft_max, self.costs, self.acceptance_by_mode[mode],
                                               self.switch, self.free_acceptance_by_mode[mode],
                                               shared_lookup=self.lookup_by_mode[mode])
        batcher = await self.batcher()
        n_ctx = batcher.context.n_ctx
        if len(request.prompt_tokens) >= n_ctx:
            raise ModelError(f"the prompt has {len(request.prompt_tokens)} tokens; the context holds "
                             f"{n_ctx}: shorten it or start duo-target with a larger --ctx-size")
        seq = batcher.join(request.prompt_tokens, private=not (request.cache_prompt and self.prompt_cache))
        try:
            if self.link:
                if generation.policy is not None:
                    generation.max_ahead = generation.policy.max_ahead()
                self.link.register(generation)
            shared = request.cache_prompt and self.prompt_cache
            if generation.lookup is not None:  # the prompt indexed off the event loop: steps index only their commits
                await generation.lookup.index_off_loop()  # (nothing extends the committed tokens before the first step)
            generation.stats.cached_prompt_tokens = await self._prefill(batcher, seq, request.prompt_tokens[:-1], shared)
            while True:
                step = await self._step(generation, batcher, seq)
                if step.finish_reason is None and len(generation.committed) >= n_ctx:
                    step = Step(step.tokens, "length")
                if step.tokens and generation.stats.first_token_at is None:
                    generation.stats.first_token_at = time.monotonic()
                if step.finish_reason:
                    generation.stats.finished_at = time.monotonic()
                    batcher.away(seq)  # nothing more comes from it: the next call need not wait
                yield step, generation.stats
                if step.finish_reason:
                    return
        finally:
            self.switch.request_done(generation.session_id)
            if self.link:
                self.link.unregister(generation.session_id)
            batcher.leave(seq, keep=request.cache_prompt and self.prompt_cache)

    @staticmethod
    async def _prefill(batcher: StepBatcher, seq: int, tokens: list[int], shared: bool) -> int:
        """Decode the prompt (but its last token, which the first step decodes) in chunks that ride
        along the running generations' steps, after the prefix some sequence already holds (`shared`;
        else from nothing); return the length of that prefix."""
        cached = pos = await batcher.adopt(seq, tokens if shared else [])
        while pos < len(tokens):
            pos += await batcher.run(PrefillWork(seq, pos, tokens[pos:]))
        return cached

    async def _await_drafts(self, generation: Generation, want: int) -> None:
        """Synchronous mode: wait until `want` drafts are pending, the draft stopped, or it is gone."""
        def enough(pending: list[int]) -> bool:
            return (not (self.link and self.link.connected) or generation.draft_refused or len(pending) >= want
                    or generation.chain.draft_paused()
                    or bool(pending and self.model.is_end_of_generation(pending[-1])))

        await generation.wait_for_drafts(enough, SYNC_WAIT_S)

    async def _wait_if_worth_it(self, generation: Generation, policy: AdaptivePolicy) -> float:
        """With no drafts pending, wait for drafts known to be coming when that is faster in expectation
        than decoding alone (policy.wait_for); the seconds waited."""
        if (generation.starved_since is None or generation.draft_silent or generation.draft_refused
                or not self.switch.speculating
                or generation.chain.has_pending()
                or generation.chain.draft_paused() or not (self.link and self.link.connected)):
            return 0.0
        began = time.monotonic()
        k, expected = policy.wait_for(generation.timing, began - generation.starved_since)
        if not k:
            return 0.0
        # A little slack past the expectation: the estimate is an average, and one late token should
        # not send the step off alone just before it arrives.
        await generation.wait_for_drafts(lambda pending: len(pending) >= k or generation.chain.draft_paused(),
                                         expected * WAIT_SLACK + WAIT_SLACK_S)
        generation.draft_silent = not generation.chain.has_pending()  # stalled or paused: stop waiting on it
        waited = time.monotonic() - began
        generation.stats.waits += 1
        generation.stats.wait_seconds += waited
        return waited

    async def _step(self, generation: Generation, batcher: StepBatcher, seq: int) -> Step:
        policy = generation.policy
        waited = 0.0
        if self.settings.sync:
            batcher.away(seq)
            await self._await_drafts(generation, self.settings.sync)
        elif policy is not None and batcher.running == 1:  # with others, the call goes anyway: ride on it
            batcher.away(seq)
            waited = await self._wait_if_worth_it(generation, policy)
        start = len(generation.committed)
        work = await generation.verify_work(seq, batcher.context.n_ctx - (start - 1), policy)
        result = await batcher.run(work)
        step = generation.commit(result.verdict, result.n_verified, result.batch_size)
        # The call's time (model work only, never the wait behind other work on the model thread).
        record = StepRecord(batch_size=result.batch_size, n_verified=result.n_verified,
                            n_accepted=result.verdict.n_accepted, n_committed=len(step.tokens),
                            seconds=result.seconds, waited=waited)
        for observer in self.observers:
            observer.on_step(record)
        if policy is not None:
            rows = policy.observe_lookup(result.batch_size, result.verdict.n_accepted, result.call_tokens,
                                         result.seconds)
            generation.stats.count_lookup(rows, policy.lookup.trials, policy.lookup.reason())
            policy.observe_acceptance(record.n_verified, record.n_accepted)
            if self.link and self.link.connected:
                self.switch.step_done(generation.session_id, len(step.tokens), record.n_verified,
                                      prefill=result.with_prefill)
            else:  # without a draft there is nothing to switch; the next step starts timing afresh
                self.switch.request_done(generation.session_id)
            generation.stats.speculation = self.switch.reason()
            self.draft_len = policy.draft_len
        self._tell_draft(generation, policy)
        return step

    def _tell_draft(self, generation: Generation, policy: AdaptivePolicy | None) -> None:
        """Send the draft what was committed since it last heard, and how far ahead to run. While the
        switch rests the draft, commits wait (one message then carries them all): a message per step
        would only cost the target's core time for a draft that does nothing with it."""
        if not self.link:
            return
        if policy is None or self.switch.draft_wanted() or not self.link.connected:
            unsent = generation.committed[generation.told:]
            if unsent:
                self.link.send(pb.TargetEvent(commit=pb.Commit(session_id=generation.session_id,
                                                               start=generation.told, tokens=unsent,
                                                               mirostat_mu=generation.mu)))
            generation.told = len(generation.committed)
        if policy is not None:
            self._steer(generation, policy.max_ahead())

    def _steer(self, generation: Generation, max_ahead: int) -> None:
        """Tell the draft how far ahead to run when the policy's view changed."""
        if self.link and max_ahead != generation.max_ahead:
            generation.max_ahead = max_ahead
            self.link.send(pb.TargetEvent(steer=pb.Steer(session_id=generation.session_id, max_ahead=max_ahead)))
