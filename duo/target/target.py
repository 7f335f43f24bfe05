"""The target's loop: every generation's steps, each step of all of them in one batched model call, each
verifying whatever chain tokens its draft sent (duo.target.generation holds one request's state)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import replace
from functools import partial
from typing import AsyncIterator, Protocol, Sequence

from duo.net._proto import duo_pb2 as pb
from duo.costs import StepCosts
from duo.llama.model import Model, ModelError
from duo.llama.worker import ModelWorker
from duo.sampling.verification import COUPLED, GREEDY, RESIDUAL
from duo.target.batching import CallObserver, PrefillWork, StepBatcher, one_token_seconds
from duo.target.generation import Generation
from duo.target.lookup_policy import LookupRecord
from duo.target.policy import Acceptance, AdaptivePolicy, DraftTiming
from duo.target.pool.connection import DraftConnection
from duo.target.pool.pool import DraftPool
from duo.target.request import GenerationStats, Request, SpecSettings, Step, StepRecord
from duo.target.switch import Switch

log = logging.getLogger("duo.target")

# A waiting step gives up this much later than the drafts were expected: WAIT_SLACK x expected + WAIT_SLACK_S.
WAIT_SLACK = 1.25
WAIT_SLACK_S = 0.002
# The synchronous mode gives up waiting for drafts after this long (a draft that stalled) and
# verifies what it has; a draft that paused (p_min) says so and is not waited for.
SYNC_WAIT_S = 1.0


class StepObserver(Protocol):
    """Something that watches the target's steps (metrics)."""

    def on_step(self, record: StepRecord) -> None: ...


class Target:
    """The target model and its drafts: runs every generation's steps, each step of all of them
    in one batched model call (duo.target.batching). Its drafts are a pool (duo.target.pool) where `drafts` is
    set or a `link` is given (it joins the pool); without, it decodes alone."""

    def __init__(self, model: Model, worker: ModelWorker, link: DraftConnection | None = None, *,
                 drafts: bool = False, n_ctx: int, settings: SpecSettings, parallel: int = 1,
                 prompt_cache: bool = True) -> None:
        self.model = model
        self.worker = worker
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
        # Whether speculation pays here, by what it delivers (duo.target.switch): the target's own switch, for the
        # requests no draft serves and the reference of decoding alone; each draft has one too (duo.target.pool).
        self.switch = Switch()
        self.pool = (DraftPool(self._draft_switch, self._draft_demand, step_seconds=self._step_seconds)
                     if drafts or link is not None else None)
        if link is not None:
            self.pool.add(link)
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
                self._batcher = StepBatcher(self.worker, context, self.costs, self.any_speculating)
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

    def _draft_switch(self) -> Switch:
        """A draft's switch: it judges its own requests' steps against the target's decoding alone (one reference,
        shared) at the target's load."""
        return Switch(rest_rates=self.switch.rest_rates, estimate_alone=self._estimate_alone, load=self._stepping)

    def _switches(self) -> list[Switch]:
        return [self.switch, *(self.pool.switches() if self.pool else [])]

    def _stepping(self) -> int:
        return sum(switch.requests for switch in self._switches())

    def any_speculating(self) -> bool:
        """Whether any switch has speculation on (the metrics' spec_decode_on)."""
        return any(switch.speculating for switch in self._switches())

    def best_gain(self) -> float | None:
        """The highest gain over decoding alone a switch last judged (None: none judged yet)."""
        gains = [switch.gain for switch in self._switches() if switch.gain is not None]
        return max(gains) if gains else None

    def _draft_demand(self) -> float:
        """Drafts a second one session can use at the current load: draft_max of them a verify step, a step of
        every running session in one call (inf before any call was timed)."""
        step = self._step_seconds()
        return max(1, self.settings.draft_max) / step if step else float("inf")

    def _step_seconds(self) -> float:
        """How long a step of every running session takes now, with draft_max drafts each (0 before any call was timed)."""
        load, k = max(1, self._stepping()), max(1, self.settings.draft_max)
        return self.costs.batch_seconds(load * (k + 1)) if self.costs.timed else 0.0

    def _serves(self, generation: Generation) -> bool:
        """Whether a draft that is up serves the request now."""
        return self.pool is not None and self.pool.serves(generation.session_id)

    def _estimate_alone(self, load: int) -> float | None:
        """Tokens per second a request decodes alone at `load` requests, from the calls timed so far: one token
        each, `load` tokens a call (a call's cost follows its tokens: S(m) = T(m) within a few % on a CPU)."""
        return 1.0 / self.costs.batch_seconds(load) if self.costs.timed else None

    async def generate(self, request: Request) -> AsyncIterator[tuple[Step, GenerationStats]]:
        """Yield the committed tokens step by step; the draft only ever changes the speed."""
        if not request.prompt_tokens:
            raise ModelError("the prompt is empty")
        generation = Generation(next(self._ids), request, self.model, self.settings, self.draft_timing)
        generation.switch = self.switch
        if self.settings.adaptive:
            mode = generation.verification
            generation.policy = AdaptivePolicy(self.settings.draft_max, self.costs, self.acceptance_by_mode[mode],
                                               generation.switch, self.free_acceptance_by_mode[mode],
                                               shared_lookup=self.lookup_by_mode[mode])
        batcher = await self.batcher()
        n_ctx = batcher.context.n_ctx
        if len(request.prompt_tokens) >= n_ctx:
            raise ModelError(f"the prompt has {len(request.prompt_tokens)} tokens; the context holds "
                             f"{n_ctx}: shorten it or start duo-target with a larger --ctx-size")
        seq = batcher.join(request.prompt_tokens, private=not (request.cache_prompt and self.prompt_cache))
        try:
            if self.pool:
                if generation.policy is not None:
                    generation.max_ahead = generation.policy.max_ahead()
                self.pool.register(generation)
            shared = request.cache_prompt and self.prompt_cache
            if generation.lookup is not None:  # the prompt indexed off the event loop: steps index only their commits
                await generation.lookup.index_off_loop()  # (nothing extends the committed tokens before the first step)
            room = max(0, min(batcher.prompt_tail_room(), batcher.context.n_batch - self.settings.draft_max - 1))
            cached, tail = await self._prefill(batcher, seq, request.prompt_tokens[:-1], shared, room)
            generation.stats.cached_prompt_tokens = cached
            while True:
                step = await self._step(generation, batcher, seq, tail)
                tail = ()
                if step.finish_reason is None and len(generation.committed) >= n_ctx:
                    step = replace(step, finish_reason="length")  # its logprobs and sources kept
                if step.tokens and generation.stats.first_token_at is None:
                    generation.stats.first_token_at = time.monotonic()
                if step.finish_reason:
                    generation.stats.finished_at = time.monotonic()
                    batcher.away(seq)  # nothing more comes from it: the next call need not wait
                yield step, generation.stats
                if step.finish_reason:
                    return
        finally:
            generation.switch.request_done(generation.session_id)
            if self.pool:
                self.pool.unregister(generation.session_id)
            batcher.leave(seq, keep=request.cache_prompt and self.prompt_cache)

    @staticmethod
    async def _prefill(batcher: StepBatcher, seq: int, tokens: list[int], shared: bool,
                       tail_room: int) -> tuple[int, list[int]]:
        """Decode the prompt (but its last token, which the first step decodes) in chunks that ride along the
        running generations' steps, after the prefix some sequence already holds (`shared`; else from nothing),
        until at most `tail_room` tokens are left: the first step reads those (VerifyWork.prompt_tail). Return
        the length of that prefix, and the tail."""
        cached = pos = await batcher.adopt(seq, tokens if shared else [])
        while len(tokens) - pos > tail_room:
            pos += await batcher.run(PrefillWork(seq, pos, tokens[pos:len(tokens) - tail_room]))
        return cached, tokens[pos:]

    async def _await_drafts(self, generation: Generation, want: int) -> None:
        """Synchronous mode: wait until `want` drafts are pending, the draft stopped, or it is gone."""
        def enough(pending: list[int]) -> bool:
            return (not self._serves(generation) or generation.draft_refused or len(pending) >= want
                    or generation.chain.draft_paused()
                    or bool(pending and self.model.is_end_of_generation(pending[-1])))

        await generation.wait_for_drafts(enough, SYNC_WAIT_S)

    async def _wait_if_worth_it(self, generation: Generation, policy: AdaptivePolicy) -> float:
        """With no drafts pending, wait for drafts known to be coming when that is faster in expectation
        than decoding alone (policy.wait_for); the seconds waited."""
        if (generation.starved_since is None or generation.draft_silent or generation.draft_refused
                or not generation.switch.speculating
                or generation.chain.has_pending()
                or generation.chain.draft_paused() or not self._serves(generation)):
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

    async def _step(self, generation: Generation, batcher: StepBatcher, seq: int,
                    prompt_tail: Sequence[int] = ()) -> Step:
        policy = generation.policy
        waited = 0.0
        if prompt_tail:  # the prompt's end is read first, at once: no draft can have drafted past it yet
            waited = 0.0
        elif self.settings.sync:
            batcher.away(seq)
            await self._await_drafts(generation, self.settings.sync)
        elif policy is not None and batcher.running == 1:  # with others, the call goes anyway: ride on it
            batcher.away(seq)
            waited = await self._wait_if_worth_it(generation, policy)
        start = len(generation.committed)
        work = await generation.verify_work(seq, batcher.context.n_ctx - (start - 1), policy, prompt_tail)
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
            switch = generation.switch
            if self._serves(generation):
                switch.step_done(generation.session_id, len(step.tokens), record.n_verified,
                                 prefill=result.with_prefill)
            else:  # without a draft there is nothing to switch; the next step starts timing afresh
                switch.request_done(generation.session_id)
            generation.stats.speculation = switch.reason()
            self.draft_len = policy.draft_len
        if self.pool is not None:  # the draft's own tokens lead the batch: its acceptance, for placement
            drafted = min(generation.split[0], record.n_verified)
            self.pool.observe_step(generation.session_id, drafted, min(record.n_accepted, drafted))
        self._tell_draft(generation, policy)
        return step

    def _tell_draft(self, generation: Generation, policy: AdaptivePolicy | None) -> None:
        """Send the draft what was committed since it last heard, and how far ahead to run. While the
        switch rests the draft, commits wait (one message then carries them all): a message per step
        would only cost the target's core time for a draft that does nothing with it."""
        if not self.pool:
            return
        if policy is None or generation.switch.draft_wanted() or not self._serves(generation):
            unsent = generation.committed[generation.told:]
            if unsent:
                self.pool.send(pb.TargetEvent(commit=pb.Commit(session_id=generation.session_id,
                                                               start=generation.told, tokens=unsent,
                                                               mirostat_mu=generation.mu)))
            generation.told = len(generation.committed)
        if policy is not None:
            self._steer(generation, policy.max_ahead())

    def _steer(self, generation: Generation, max_ahead: int) -> None:
        """Tell the draft how far ahead to run when the policy's view changed."""
        if self.pool and max_ahead != generation.max_ahead:
            generation.max_ahead = max_ahead
            self.pool.send(pb.TargetEvent(steer=pb.Steer(session_id=generation.session_id, max_ahead=max_ahead)))
