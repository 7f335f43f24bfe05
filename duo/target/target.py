"""The target's loop: every generation's steps, each step of all of them in one batched model call, each
verifying whatever chain tokens its draft sent (duo.target.generation holds one request's state)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from contextlib import aclosing
from dataclasses import replace
from functools import partial
from typing import AsyncIterator, Protocol, Sequence

from duo.net._proto import duo_pb2 as pb
from duo.llama.model import N_BATCH, Model, ModelError
from duo.llama.parking import DEFAULT_LIMIT_MIB, parking_for
from duo.llama.worker import ModelWorker
from duo.target.batching import CallObserver, PrefillWork, StepBatcher, VerifyResult, one_token_seconds
from duo.target.control import SpeculationControl
from duo.target.generation import Generation
from duo.target.policy import AdaptivePolicy
from duo.target.pool.connection import DraftConnection
from duo.target.progress import ReadClock, ReadProgress
from duo.target.request import GenerationStats, Request, SpecSettings, Step, StepRecord, StepTimes

log = logging.getLogger("duo.target")

# A waiting step gives up this much later than the drafts were expected: WAIT_SLACK x expected + WAIT_SLACK_S.
WAIT_SLACK = 1.25
WAIT_SLACK_S = 0.002
# The synchronous mode gives up waiting for drafts after this long (a draft that stalled) and
# verifies what it has; a draft that paused (p_min) says so and is not waited for.
SYNC_WAIT_S = 1.0


class DecodeClock:
    """Counts a request's steps into its StepTimes from its first token to its end, on time.monotonic() (the clock
    of GenerationStats.first_token_at and finished_at): the parts then add up to the time between the two."""

    def __init__(self, times: StepTimes) -> None:
        self.times = times
        self.since: float | None = None  # the end of what is counted (None: before the first token)

    def start(self, now: float) -> None:
        """The first token came out `now`: the decode begins."""
        self.since = now

    def step(self, began: float, drafts: float, queue: float, result: VerifyResult, ended: float) -> None:
        """A step from `began` to `ended`: `drafts` waiting for drafts, `queue` in the batcher beside its call,
        `result`'s call (decode, then verification); duo's work on the event loop the rest. Uncounted before the
        first token (the prompt's read)."""
        if self.since is None:
            return
        check = result.seconds - result.decode_seconds
        work = ended - began - drafts - queue - result.seconds
        self.times.add_step(drafts=drafts, work=work, queue=queue, verify=result.decode_seconds, check=check,
                            between=began - self.since)
        self.since = ended

    def end(self, now: float) -> None:
        """The request ended `now`: what followed its last step counts as between steps."""
        if self.since is not None:
            self.times.between += now - self.since
            self.since = now


class StepObserver(Protocol):
    """Something that watches the target's steps (metrics)."""

    def on_step(self, record: StepRecord) -> None: ...


class Target:
    """The target model and its drafts: runs every generation's steps, each step of all of them
    in one batched model call (duo.target.batching), as speculation control (duo.target.control) plans each and learns
    from it. Its drafts are a pool (duo.target.pool) where `drafts` is set or a `link` is given (it joins the pool);
    without, it decodes alone."""

    def __init__(self, model: Model, worker: ModelWorker, link: DraftConnection | None = None, *,
                 drafts: bool = False, n_ctx: int, settings: SpecSettings, parallel: int = 1,
                 prompt_cache: bool = True, flash_attn: bool | None = None, n_batch: int = N_BATCH,
                 cache_ram: int = DEFAULT_LIMIT_MIB) -> None:
        """`flash_attn`: llama.cpp's flash attention on or off for the shared context (None: llama.cpp's choice);
        `n_batch`: the most tokens one model call decodes (llama-server's -b: a prompt is read n_batch at a time);
        `cache_ram`: MiB of host memory for idle sequences' prefixes (duo.llama.parking.parking_for)."""
        self.model = model
        self.worker = worker
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.flash_attn = flash_attn
        self.parallel = parallel  # generations at once: one sequence each in the shared context
        self.prompt_cache = prompt_cache  # requests may start from prompt prefixes others left
        self.cache_ram = cache_ram
        self.settings = settings
        self.control = SpeculationControl(settings, drafts=drafts or link is not None)
        self.pool = self.control.pool  # control reads its drafts' switches; the sessions' events go through it here
        if link is not None:
            self.pool.add(link)
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
                                                           cells=n_ctx * self.parallel, flash_attn=self.flash_attn,
                                                           n_batch=self.n_batch), n_ctx)
                self._batcher = StepBatcher(self.worker, context, self.control.costs, self.control.any_speculating,
                                            parking_for(context, self.cache_ram))
                self._batcher.observers = self.call_observers
                self.control.observe_alone(await self.worker.run(one_token_seconds, context))
        return self._batcher

    async def close(self) -> None:
        """Free the shared context (no generation may be running)."""
        if self._batcher is not None:
            await self.worker.close(self._batcher.context)
            self._batcher = None

    async def generate(self, request: Request, stats: GenerationStats | None = None, progress: bool = False
                       ) -> AsyncIterator[tuple[Step | ReadProgress, GenerationStats]]:
        """Yield the committed tokens step by step; the draft only ever changes the speed. `stats`: the request's
        counters to fill as it runs, which its caller reads even where it ends before its first step (a client that
        left during the prompt read still counts the prefix it found in the cache). `progress`: first yield how far
        the prompt's read got, once the cache's prefix is known and after each read call (the last, with the
        prompt's end, just before the first step's tokens), as llama-server's return_progress tells it."""
        if not request.prompt_tokens:
            raise ModelError("the prompt is empty")
        generation = Generation(next(self._ids), request, self.model, self.settings, self.control.draft_timing, stats)
        self.control.add(generation)
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
            read, clock, pos = request.prompt_tokens[:-1], None, 0
            async with aclosing(self._read(batcher, seq, read, shared, generation.stats)) as positions:
                async for pos in positions:
                    if progress:
                        clock = clock or ReadClock(len(request.prompt_tokens), pos)
                        yield clock.at(pos), generation.stats
            tail: Sequence[int] = read[pos:]
            steps = DecodeClock(generation.stats.times)
            while True:
                step = await self._step(generation, batcher, seq, tail, steps)
                if clock is not None:  # the first step read the prompt's end
                    yield clock.at(len(request.prompt_tokens)), generation.stats
                    clock = None
                tail = ()
                if step.finish_reason is None and len(generation.committed) >= n_ctx:
                    step = replace(step, finish_reason="length")  # its logprobs and sources kept
                now = time.monotonic()
                if step.tokens and generation.stats.first_token_at is None:
                    generation.stats.first_token_at = now
                    steps.start(now)
                if step.finish_reason:
                    generation.stats.finished_at = now
                    steps.end(now)
                    batcher.away(seq)  # nothing more comes from it: the next call need not wait
                yield step, generation.stats
                if step.finish_reason:
                    return
        finally:
            self.control.finish(generation)
            if self.pool:
                self.pool.unregister(generation.session_id)
            batcher.leave(seq, keep=request.cache_prompt and self.prompt_cache)

    @staticmethod
    async def _read(batcher: StepBatcher, seq: int, tokens: list[int], shared: bool,
                    stats: GenerationStats) -> AsyncIterator[int]:
        """Decode the prompt (but its last token, which the first step decodes) after the prefix some sequence
        already holds (`shared`; else from nothing), in chunks that ride along the running generations' steps, until
        the tail the first step reads before its own rows is left (StepBatcher.prompt_tail: alone, the prompt is read
        n_batch tokens a call, as llama-server reads it). Yield the tokens of `tokens` the sequence holds: once the
        cache's prefix is known, then after each chunk; the tail is what the last leaves.

        The prefix found is counted before the read: a request cancelled during it says what it found. Cancelled,
        the read stops after the chunk in flight, and every chunk decoded stays in the sequence's cells (leave keeps
        them): the same prompt sent again (an agent's retry after its idle timeout) starts from them.

        Where an earlier request is reading the same prefix, at least a chunk of it past what this one holds, this
        one waits for its cells instead of reading them too, and counts them as cached (duo.target.following)."""
        stats.cached_prompt_tokens = pos = await batcher.adopt(seq, tokens if shared else [])
        yield pos
        end = len(tokens) - batcher.prompt_tail(len(tokens) - pos)
        if shared:
            batcher.readers.start(seq, tokens[:end])  # what its read holds when it ends (its first step reads on)
        following = shared
        try:
            while pos < end:
                lead = batcher.readers.leader(seq, tokens, pos) if following else None
                if lead is None:
                    pos += await batcher.run(PrefillWork(seq, pos, tokens[pos:end]))
                else:  # an earlier request reads the same prefix: its cells, once read, are this one's too
                    batcher.away(seq)  # no call waits for this request meanwhile
                    await batcher.readers.follow(*lead)
                    adopted = await batcher.adopt(seq, tokens)
                    following = adopted > pos  # nothing gained (the leader's cells went): the rest read alone
                    stats.cached_prompt_tokens += adopted - pos
                    pos = adopted
                yield pos
        finally:
            batcher.readers.stop(seq)

    async def _await_drafts(self, generation: Generation, want: int) -> None:
        """Synchronous mode: wait until `want` drafts are pending, the draft stopped, or it is gone."""
        def enough(pending: list[int]) -> bool:
            return (not self.control.serves(generation) or generation.draft_refused or len(pending) >= want
                    or generation.chain.draft_paused()
                    or bool(pending and self.model.is_end_of_generation(pending[-1])))

        await generation.wait_for_drafts(enough, SYNC_WAIT_S)

    async def _wait_if_worth_it(self, generation: Generation, policy: AdaptivePolicy) -> float:
        """With no drafts pending, wait for drafts known to be coming when that is faster in expectation
        than decoding alone (policy.wait_for); the seconds waited."""
        if (generation.starved_since is None or generation.draft_silent or generation.draft_refused
                or not generation.switch.speculating
                or generation.chain.has_pending()
                or generation.chain.draft_paused() or not self.control.serves(generation)):
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

    async def _gather_drafts(self, generation: Generation, batcher: StepBatcher, seq: int,
                             prompt_tail: Sequence[int]) -> tuple[float, float]:
        """Before a step: wait for drafts where that pays (the synchronous mode: for `sync` of them); the seconds
        waited, as the step's record counts them (the synchronous mode's wait is its regime: none), and in all."""
        if prompt_tail:  # the prompt's end is read first, at once: no draft can have drafted past it yet
            return 0.0, 0.0
        if self.settings.sync:
            batcher.away(seq)
            began = time.monotonic()
            await self._await_drafts(generation, self.settings.sync)
            return 0.0, time.monotonic() - began
        if generation.policy is not None and batcher.running == 1:  # with others, the call goes anyway: ride on it
            batcher.away(seq)
            waited = await self._wait_if_worth_it(generation, generation.policy)
            return waited, waited
        return 0.0, 0.0

    async def _step(self, generation: Generation, batcher: StepBatcher, seq: int,
                    prompt_tail: Sequence[int], clock: DecodeClock) -> Step:
        """One step of the request: gather drafts, plan what to verify, verify it in the batched call, commit, and
        let speculation control observe what the step did; `clock` counts where its time went."""
        began = time.monotonic()
        waited, drafts = await self._gather_drafts(generation, batcher, seq, prompt_tail)
        plan = self.control.plan(generation)  # after the wait: a draft may have taken the session meanwhile
        start = len(generation.committed)
        # The batch holds the prompt's tail, the newest token and the drafts: it must fit one call (n_batch).
        room = min(batcher.context.n_ctx - (start - 1), batcher.context.n_batch - len(prompt_tail))
        work = await generation.verify_work(seq, room, plan, prompt_tail)
        submitted = time.monotonic()
        result = await batcher.run(work)
        returned = time.monotonic()
        step = generation.commit(result.verdict, result.n_verified, result.batch_size)
        # The call's time (model work only, never the wait behind other work on the model thread).
        record = StepRecord(batch_size=result.batch_size, n_verified=result.n_verified,
                            n_accepted=result.verdict.n_accepted, n_committed=len(step.tokens),
                            seconds=result.seconds, waited=waited)
        for observer in self.observers:
            observer.on_step(record)
        self.control.observe(generation, result, record)
        self._tell_draft(generation, plan.policy)
        clock.step(began, drafts, returned - submitted - result.seconds, result, time.monotonic())
        return step

    def _tell_draft(self, generation: Generation, policy: AdaptivePolicy | None) -> None:
        """Send the draft what was committed since it last heard, and how far ahead to run. While the
        switch rests the draft, commits wait (one message then carries them all): a message per step
        would only cost the target's core time for a draft that does nothing with it."""
        if not self.pool:
            return
        if policy is None or generation.switch.draft_wanted() or not self.control.serves(generation):
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
