"""The target's model calls: every running request's verify step, and prompt chunks, decoded in one batch.

Decoding a memory-bound model reads every weight once per call whatever the batch holds, so one call
carrying all running requests' verify batches costs about as much as one of them (F16 1.5B on one
CPU core: 4 sequences of one token each cost 2.0 single steps, 10 tokens over 4 sequences 3.5). Each
request owns one sequence of a shared context (duo.llama.context.Context, a unified KV cache): its tokens,
its verification and its rollback stay its own.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence

import numpy as np

from duo.costs import StepCosts
from duo.llama.model import ModelError
from duo.llama.context import Context, Part, common_prefix_length
from duo.llama.parking import Parking
from duo.llama.worker import ModelWorker
from duo.net.timeouts import within
from duo.sampling import rows
from duo.sampling.distributions import NoTokenAllowed, SparseDist, chain_log_probs, log_probs
from duo.sampling.ops.penalties import OutputCounts, Penalties
from duo.sampling.params import SamplingParams
from duo.sampling.verification import Verdict, verify
from duo.target.following import Readers
from duo.target.policy import AdaptivePolicy, choose_together

log = logging.getLogger("duo.target")

# After a call, the requests it served get this long to ask for their next step before the next
# call starts without them. They only commit, tell the draft and hand their tokens to their client
# (well under a millisecond), but a client slow to take its tokens must not hold the others up.
GATHER_S = 0.02
# A prompt chunk decoded beside running requests' steps may make the call cost at most this many
# times the steps alone: a long prompt then delays each running request by about one step per chunk.
PREFILL_STALL = 2.0
MIN_PREFILL_CHUNK = 16  # a prompt moves on by at least this many tokens per call
ALONE_TIMING_CALLS = 5  # one-token calls timed at start, for the switch's first reference


class CallObserver(Protocol):
    """Something that watches the target's model calls (metrics)."""

    def on_call(self, requests: int, tokens: int) -> None: ...


@dataclass
class VerifyWork:
    """A request's verify step: decode [its newest committed token, the first k drafts] at the end of
    its sequence, where the call's plan picks k <= limit, and verify the drafts against the logits."""

    seq: int
    pos: int                         # the newest committed token's position
    last: int                        # the newest committed token
    pending: list[int]               # the drafts it may verify, in chain order
    dists: list[SparseDist | None]   # what each was drawn from (residual verification)
    limit: int                       # the most drafts its batch may hold (draft_max, the room left)
    draft_min: int                   # fewer than this: verify none
    policy: AdaptivePolicy | None    # adaptive: the plan picks k; else k = limit
    params: SamplingParams
    rng: np.random.Generator
    coupled_seed: int | None
    # Row i of the step follows the tokens generated so far and the first i drafts. Under a grammar, row i's mask
    # (True: allowed) there, computed off the model thread before the call (duo.target.generation): rows past them
    # (after a drafted end) are never committed. Where penalties are active, the counts of the output's tokens.
    masks: list[np.ndarray] | None = None
    penalties: Penalties = Penalties()
    counted: OutputCounts | None = None
    logprobs: int = -1  # >= 0: each committed token's log-probability and this many alternatives' (-1: none)
    post_sampling: bool = False  # those of the distribution drawn from, after the whole chain (not the row's softmax)
    committed: Sequence[int] = ()  # the prompt and the committed output (DRY reads them), unchanged until the result
    mu: float | None = None  # mirostat's state after them (None without mirostat)
    # A request's first step may read the rest of its prompt before `last`, at positions pos - len(tail) ... pos - 1:
    # its first token then comes from the call that reads the prompt's end, not from a call of its own after it (a
    # whole T(1) more before the first token: ~100 ms for an F16 1.5B target on a CPU core, as llama-server does it).
    prompt_tail: Sequence[int] = ()

    @property
    def size(self) -> int:
        """The most tokens its part of a call may hold."""
        return len(self.prompt_tail) + 1 + self.limit


@dataclass(frozen=True)
class VerifyResult:
    verdict: Verdict
    n_verified: int   # drafts verified (one more than the batch held when the last row checks one)
    batch_size: int   # this request's tokens in the call
    seconds: float    # the whole call's model time: decode and every request's verification
    with_prefill: bool = False  # the call also decoded a prompt chunk (of this request or another)
    call_tokens: int = 0  # the whole call's tokens (every request's and prompt chunks)
    decode_seconds: float = 0.0  # of `seconds`, llama.cpp's decode of the batch (the rest: every verification)


@dataclass
class PrefillWork:
    """Prompt tokens to decode into a request's sequence, as many per call as the plan allows."""

    seq: int
    pos: int
    tokens: list[int]


Work = VerifyWork | PrefillWork


@dataclass
class _Planned:
    work: Work
    future: asyncio.Future
    part: Part
    drafts: list[int]                    # verify: the drafts to verify
    dists: list[SparseDist | None]


class StepBatcher:
    """Decodes the work of every running request in one call per step, on one shared context.

    Requests join (taking a sequence), then submit one piece of work at a time with `run` and wait
    for its result. A call starts as soon as work is waiting and every request the previous call
    served has asked again, or said it will not soon (`away`: it waits for drafts), or GATHER_S has
    passed; work that comes later rides on the next call.
    """

    def __init__(self, worker: ModelWorker, context: Context, costs: StepCosts,
                 drafting: Callable[[], bool] = lambda: True, parking: Parking | None = None) -> None:
        """`parking`: where the idle sequences' prefixes wait while a request runs (None: in the cache)."""
        self.worker = worker
        self.context = context
        self.parking = parking
        # T(n) of verify calls while the draft works: the policy's table, which it reads only then. Calls
        # while the draft rests cost a little less (duo.target.switch measures that regime by its own rate).
        self.costs = costs
        self.drafting = drafting
        # Every call's cost, prompt chunks included, for sizing the chunks: a prefill skips the output
        # layer and verification, so it would make verify batches of its size look cheaper than they are.
        self.call_costs = StepCosts()
        self._free = list(range(context.n_seq))  # sequences no request holds (their cells kept for reuse)
        self._queue: list[tuple[Work, asyncio.Future]] = []
        self._thinking: set[int] = set()  # served by the last call and not yet back
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.observers: list[CallObserver] = []
        # Sequences whose cells may hold a private request's tokens (cache_prompt false: it shares its prompt with no
        # other request, while it runs or after it ended): never a source of adoption, emptied by the adopt of the
        # next request that takes one. Of those, the ones a private request holds now.
        self._private: set[int] = set()
        self._held_privately: set[int] = set()
        self.readers = Readers(context)  # the prompts being read: a later read of the same prefix follows the first

    @property
    def running(self) -> int:
        """Requests holding a sequence."""
        return self.context.n_seq - len(self._free)

    def join(self, prompt: Sequence[int], private: bool = False) -> int:
        """A sequence for a new request: of the free ones, the one whose cells lose the least of what they
        hold (`prompt` continues its conversation, or it is empty) rather than another conversation's
        cache, a later turn of which may come; among equals, the one free the longest. A `private` request
        (cache_prompt false) takes nothing from any cells, and no request takes from its own.

        adopt() then gives it the longest prefix of `prompt` held by a sequence no private request holds or left,
        whichever sequence it took.
        """
        if not self._free:
            raise ModelError(f"all {self.context.n_seq} sequences of the target's context are in use")
        wanted = [] if private else prompt

        def lost(seq: int) -> int:
            if seq in self._private:
                return 0  # cells no other request may use
            # One copy, made in one step (a list's copy holds the GIL throughout): the model thread may be rolling
            # this sequence back meanwhile (a request that left during a call), and reading the live list twice,
            # its length and then its tokens, could index past its new end. The copy may be stale: a hint.
            held = list(self.context.held(seq))
            return len(held) - common_prefix_length(held, wanted)

        seq = min(self._free, key=lost)  # the first of equals: _free is in the order they were freed
        self._free.remove(seq)
        if private:
            self._private.add(seq)
            self._held_privately.add(seq)
        return seq

    async def adopt(self, seq: int, prompt: Sequence[int]) -> int:
        """Give the request on `seq` the longest prefix of `prompt` that a sequence holds, with no recompute
        (duo.llama.context.Context.adopt_prefix), from no sequence a private request holds or left; the prompt tokens it
        need not decode.

        On the model thread, which runs one job at a time in order: no call touches the context meanwhile.
        """
        wanted = [] if seq in self._held_privately else list(prompt)
        adopted = await self.worker.run(_adopt_and_park, self.context, self.parking, seq, wanted,
                                        frozenset(self._private), tuple(self._free))
        if seq not in self._held_privately:
            self._private.discard(seq)  # the adopt emptied what a private request left there
        return adopted

    def leave(self, seq: int, keep: bool = True) -> None:
        """The request on `seq` ended: its sequence is free for another, its cells kept until then (a
        later request may start from them; `keep` False: none may, they hold nothing to share)."""
        if not keep:
            # Emptied by the adopt of the next request that takes it, in that job: a clear queued apart from it
            # would reach the model thread only when its task first ran, after work submitted meanwhile (the next
            # request's adopt, which would start from these cells; the context's close).
            self._private.add(seq)
        self._held_privately.discard(seq)
        self.readers.stop(seq)
        self.away(seq)
        self._queue = [(work, future) for work, future in self._queue if work.seq != seq]
        self._free.append(seq)

    def away(self, seq: int) -> None:
        """The request on `seq` will not ask for a while (it waits for drafts): do not wait for it."""
        self._thinking.discard(seq)
        self._changed.set()

    async def run(self, work: Work) -> VerifyResult | int:
        """Do `work` in the next call: a VerifyResult, or for a prefill the prompt tokens it decoded."""
        self._thinking.discard(work.seq)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append((work, future))
        self._changed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._calls())
        return await future  # cancelled: the call that takes it skips it (or its result goes nowhere)

    async def _calls(self) -> None:
        while self._queue:
            await self._gather()
            batch, self._queue = self._take(self._queue)
            planned: list[_Planned] = []
            try:
                planned = self._plan(batch)
                results, (seconds, decode_seconds) = await self.worker.run(_decode_and_verify, self.context, planned)
            except Exception as error:  # the call failed: every request in it hears why
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            self._deliver(planned, results, seconds, decode_seconds)

    def _deliver(self, planned: list[_Planned], results: list[Verdict | int | Exception], seconds: float,
                 decode_seconds: float) -> None:
        tokens = sum(len(item.part.tokens) for item in planned)
        with_prefill = any(isinstance(item.work, PrefillWork) or item.work.prompt_tail for item in planned)
        self.call_costs.observe(tokens, seconds)
        if self.drafting() and not with_prefill:
            self.costs.observe(tokens, seconds)
        for observer in self.observers:
            observer.on_call(len(planned), tokens)
        for item, result in zip(planned, results):
            if item.future.done():  # its request left meanwhile
                continue
            if isinstance(result, Exception):
                item.future.set_exception(result)
                continue
            if isinstance(result, Verdict):
                batch = len(item.part.tokens) - len(item.work.prompt_tail)  # its own rows, not the prompt's end
                result = VerifyResult(result, len(item.drafts), batch, seconds, with_prefill, tokens, decode_seconds)
            self._thinking.add(item.work.seq)
            item.future.set_result(result)
        if with_prefill:
            self.readers.progressed()

    async def _gather(self) -> None:
        """Wait, at most GATHER_S, for the requests the last call served to come back."""
        deadline = time.monotonic() + GATHER_S
        while self._thinking and (left := deadline - time.monotonic()) > 0:
            self._changed.clear()
            try:
                await within(self._changed.wait(), left)
            except asyncio.TimeoutError:
                break
        self._thinking.clear()

    def _take(self, queue: list[tuple[Work, asyncio.Future]]) -> tuple[list, list]:
        """The work that fits one call (n_batch tokens: every verify batch whole), and what waits."""
        taken, rest, tokens = [], [], 0
        for work, future in queue:
            size = work.size if isinstance(work, VerifyWork) else 1
            if future.done() or (taken and tokens + size > self.context.n_batch):
                rest += [] if future.done() else [(work, future)]
                continue
            taken.append((work, future))
            tokens += size
        return taken, rest

    def _plan(self, batch: list[tuple[Work, asyncio.Future]]) -> list[_Planned]:
        """Each request's part of the call: draft lengths chosen together, then prompt chunks."""
        verifying = [(work, future) for work, future in batch if isinstance(work, VerifyWork)]
        ks = self._draft_lengths([work for work, _ in verifying])
        planned = []
        for (work, future), k in zip(verifying, ks):
            k = 0 if k < work.draft_min else k
            n_verify = min(len(work.pending), k + 1)  # the last row checks one draft beyond the batch
            tail = len(work.prompt_tail)
            part = Part(work.seq, work.pos - tail, [*work.prompt_tail, work.last, *work.pending[:k]],
                        range(tail, tail + k + 1))
            planned.append(_Planned(work, future, part, work.pending[:n_verify], work.dists[:n_verify]))
        step_tokens = sum(len(item.part.tokens) for item in planned)
        budget = self._prefill_budget(step_tokens)
        for work, future in batch:
            if isinstance(work, PrefillWork):
                n = min(len(work.tokens), budget)
                if not n:  # the call is full: the next one takes it
                    self._queue.append((work, future))
                    continue
                budget -= n
                planned.append(_Planned(work, future, Part(work.seq, work.pos, work.tokens[:n], []), [], []))
        return planned

    def _draft_lengths(self, works: list[VerifyWork]) -> list[int]:
        """Adaptive requests: the lengths that make the call commit the most tokens per second
        (duo.target.policy.allocate); the others verify all they may."""
        adaptive = [work for work in works if work.policy is not None]
        chosen = dict(zip((id(work) for work in adaptive),
                          choose_together([work.policy for work in adaptive], [work.limit for work in adaptive],
                                          self.costs, sum(w.size for w in works if w.policy is None)
                                          + sum(len(w.prompt_tail) for w in adaptive))))
        return [chosen[id(work)] if work.policy is not None else work.limit for work in works]

    def prompt_tail(self, unread: int) -> int:
        """Of a prompt's `unread` tokens (its last one aside), those its first step reads before its own rows. Alone,
        the prompt is read as llama-server reads it, n_batch tokens a call, the last call's with the first token:
        the first step reads what is left over whole chunks (it verifies fewer drafts to fit). Beside others, a
        chunk at most (less than a call: the step's own row must fit beside it): their steps ride in that call, and a
        long read would hold them (_prefill_budget)."""
        if self.running <= 1:
            return unread % self.context.n_batch
        return min(unread, MIN_PREFILL_CHUNK, self.context.n_batch - 1)

    def _prefill_budget(self, step_tokens: int) -> int:
        """Prompt tokens this call may carry: a whole batch when no request is generating, else as many
        as keep the call within PREFILL_STALL times the cost of the steps alone."""
        room = self.context.n_batch - step_tokens
        if not step_tokens:
            return room
        limit = PREFILL_STALL * self.call_costs.batch_seconds(step_tokens)
        chunk = MIN_PREFILL_CHUNK
        while chunk * 2 <= room and self.call_costs.batch_seconds(step_tokens + chunk * 2) <= limit:
            chunk *= 2
        return min(chunk, room)


def _adopt_and_park(context: Context, parking: Parking | None, seq: int, wanted: Sequence[int],
                    private: frozenset[int], idle: Sequence[int]) -> int:
    """StepBatcher.adopt on the model thread: the `idle` sequences (no request holds them) leave the cache for the
    parking, where their cells would slow every other request's calls (duo.llama.parking), then `seq` adopts its
    prefix from the cache or a parked one. Parked first, their cells are free for the run of cells a restore needs."""
    if parking is None:
        return context.adopt_prefix(seq, wanted, private)
    parking.park((other for other in idle if other != seq), private)
    return parking.adopt(seq, wanted, private)


def one_token_seconds(context: Context, calls: int = ALONE_TIMING_CALLS) -> float:
    """The median seconds of a one-token call on sequence 0 (left empty after): decoding alone, timed by the
    model thread while nothing else runs on it, before the first request."""
    times = []
    for pos in range(calls):
        began = time.perf_counter()
        context.decode([0], pos, logits_for=[0])
        times.append(time.perf_counter() - began)
    context.clear(0)
    return statistics.median(times)


def _logprobs(work: VerifyWork, rows: np.ndarray, tokens: Sequence[int]) -> list[tuple[float, list[tuple[int, float]]]]:
    """The committed tokens' logprobs, from their rows as verified: of the row's softmax, or where the request asks
    (llama-server's post_sampling_probs) of the distribution each token was drawn from."""
    if work.post_sampling:
        return chain_log_probs(rows, tokens, work.params, work.mu, work.logprobs)
    return [log_probs(row, token, work.logprobs) for row, token in zip(rows, tokens)]


def _decode_and_verify(context: Context,
                       planned: Sequence[_Planned]) -> tuple[list[Verdict | int | Exception], tuple[float, float]]:
    """One model call (on the model thread): decode every part, verify each request's drafts against
    its rows and drop its rejected drafts' cache entries. A request whose verification fails gets its
    error alone. Also (the call's seconds, of them the decode's)."""
    began = time.perf_counter()
    blocks = context.decode_parts([item.part for item in planned])
    decoded = time.perf_counter()
    results: list[Verdict | int | Exception] = []
    for item, logits in zip(planned, blocks):
        work = item.work
        if isinstance(work, PrefillWork):
            results.append(len(item.part.tokens))
            continue
        try:
            # p is the target's after the tokens each row follows, constrained: the draft's q comes from the same function
            rows.transform(work.penalties, logits, work.committed, item.part.tokens[len(work.prompt_tail) + 1:],
                           work.counted, work.masks)
            verdict = verify(item.drafts, item.dists, logits, work.params, work.rng, work.coupled_seed, work.pos + 1,
                             work.mu)
            if work.logprobs >= 0:  # from the rows as verified: after the penalties and the grammar
                verdict = replace(verdict, logprobs=_logprobs(work, logits, verdict.tokens))
            # Cache entries are right up to the last accepted draft that was in the batch.
            drafted = len(item.part.tokens) - len(work.prompt_tail) - 1
            context.rollback(work.pos + 1 + min(verdict.n_accepted, drafted), work.seq)
            results.append(verdict)
        except NoTokenAllowed as error:  # the request's own logit_bias and grammar: no traceback to read
            log.info("sequence %d ends: %s", work.seq, error)
            results.append(error)
        except Exception as error:  # this request's alone; the others' verdicts stand
            log.exception("verifying session on sequence %d failed", work.seq)
            results.append(error)
    ended = time.perf_counter()
    return results, (ended - began, decoded - began)
