"""The target's steps as its adaptive policy sees them: the model work alone, and waits that pay."""

from __future__ import annotations

import asyncio
import time

import pytest

from duo.costs import PRIOR_BATCH_SLOPE
from duo.llama.worker import ModelWorker
from duo.net._proto import duo_pb2 as pb
from duo.net.wire import ChainChunk
from duo.sampling.params import SamplingParams
from duo.target import switch as sw
from duo.target.generation import Generation
from duo.target.policy import AdaptivePolicy
from duo.target.request import Request, SpecSettings, StepRecord
from duo.target.switch import Switch
from duo.target.target import SYNC_WAIT_S, Target
from helpers.fake_drafts import RecordingDraft
from helpers.generation import answer_of

BLOCK_S = 0.15  # another request's work on the model thread, in front of every step


class Records:
    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)


def test_a_step_is_timed_without_the_wait_behind_other_work_on_the_model_thread(target_model):
    worker = ModelWorker()
    target = Target(target_model, worker, None, n_ctx=256, settings=SpecSettings())
    seen = Records()
    target.observers.append(seen)

    async def run() -> float:
        began = time.perf_counter()
        async for step, _ in target.generate(Request([9707, 11, 1879], SamplingParams(), max_tokens=6)):
            # Queue a long job before the next step: that step then waits BLOCK_S for the model thread.
            asyncio.ensure_future(worker.run(time.sleep, BLOCK_S))
            await asyncio.sleep(0)
        return time.perf_counter() - began

    elapsed = asyncio.run(run())
    assert len(seen.records) == 6 and elapsed > 5 * BLOCK_S  # the steps really waited
    assert max(record.seconds for record in seen.records) < BLOCK_S / 2
    # The policy learnt the same model-only cost.
    assert target.control.costs.batch_seconds(1) < BLOCK_S / 2



# How late a loaded 2-core machine may run an event loop's timers: the bounds stay far below SYNC_WAIT_S (1 s),
# the wait that these tests tell apart from the short ones.
LOAD_SLACK_S = 0.2


def waiting_target_and_generation() -> tuple[Target, Generation, AdaptivePolicy]:
    """A slow target (T(n) = 140 ms) whose draft answers a commit in 10 ms and then drafts every 5 ms."""
    target = Target(None, ModelWorker(), RecordingDraft(), n_ctx=256, settings=SpecSettings())
    for n in range(1, 18):
        target.control.costs.observe(n, 0.140)
    timing = target.pool.members[0].timing  # the draft's, which judges the sessions placed on it
    timing.latency.add(0.010)
    timing.per_token.add(0.005)
    generation = Generation(1, Request([1, 2, 3], SamplingParams()), None, SpecSettings(), target.control.draft_timing)
    generation.switch = target.control.switch
    target.pool.register(generation)
    generation.starved_since = time.monotonic()
    return target, generation, AdaptivePolicy(16, target.control.costs)


def test_with_a_much_faster_draft_the_target_waits_for_the_drafts_it_knows_are_coming():
    target, generation, policy = waiting_target_and_generation()

    async def run() -> float:
        async def draft() -> None:
            for i in range(16):
                await asyncio.sleep(0.005)
                generation.on_chunk(ChainChunk(epoch=0, start=3 + i, tokens=[100 + i], dists=[]))
        drafting = asyncio.ensure_future(draft())
        waited = await target._wait_if_worth_it(generation, policy)
        await drafting
        return waited

    waited = asyncio.run(run())
    assert 0.005 < waited < 0.070 + LOAD_SLACK_S  # half a step at the most (the event loop may run late)
    assert generation.stats.waits == 1 and generation.stats.wait_seconds == pytest.approx(waited)
    assert len(generation.chain.pending()[0]) >= 2


def test_a_wait_that_finds_nothing_is_not_repeated_until_the_draft_sends_again():
    target, generation, policy = waiting_target_and_generation()
    first = asyncio.run(target._wait_if_worth_it(generation, policy))
    assert first > 0 and generation.draft_silent
    assert asyncio.run(target._wait_if_worth_it(generation, policy)) == 0.0
    generation.on_chunk(ChainChunk(epoch=0, start=3, tokens=[7], dists=[]))
    assert not generation.draft_silent


def test_a_draft_that_says_it_paused_is_not_waited_for_and_a_pause_ends_a_wait_at_once():
    target, generation, policy = waiting_target_and_generation()
    generation.on_chunk(ChainChunk(epoch=0, start=3, tokens=[], dists=[], paused=True))
    assert generation.chain.draft_paused()
    assert asyncio.run(target._wait_if_worth_it(generation, policy)) == 0.0 and generation.stats.waits == 0

    target, generation, policy = waiting_target_and_generation()

    async def run() -> float:
        async def draft() -> None:
            await asyncio.sleep(0.005)
            generation.on_chunk(ChainChunk(epoch=0, start=3, tokens=[9], dists=[], paused=True))
        drafting = asyncio.ensure_future(draft())
        waited = await target._wait_if_worth_it(generation, policy)
        await drafting
        return waited

    # it expected more than one draft, but the pause came with the first (a late event loop aside)
    assert 0.004 < asyncio.run(run()) < 0.05 + LOAD_SLACK_S

    async def synchronous() -> None:  # the synchronous mode's wait (SYNC_WAIT_S) ends at the pause too
        generation.chain.reset()
        generation.on_chunk(ChainChunk(epoch=1, start=3, tokens=[], dists=[], paused=True))
        await target._await_drafts(generation, 4)

    began = time.monotonic()
    asyncio.run(synchronous())
    assert time.monotonic() - began < SYNC_WAIT_S / 2


class InstantDraft(RecordingDraft):
    """A link to a draft that knows the answer: on a session's opening it sends `answer` as its chain
    at once, if the session asked for drafts at all (max_ahead > 0)."""

    def __init__(self, answer: list[int]) -> None:
        super().__init__()
        self.answer = answer
        self.opened_with: list[int] = []

    def register(self, generation: Generation) -> None:
        message = generation.open_message()
        self.opened_with.append(message.max_ahead)
        if message.max_ahead:
            generation.on_chunk(ChainChunk(epoch=0, start=len(message.committed),
                                           tokens=self.answer[:message.max_ahead], dists=[]))

    def unregister(self, session_id: int) -> None:
        pass

    def send(self, event) -> None:
        pass


def test_the_first_step_of_a_request_verifies_the_drafts_sent_since_the_session_opened(target_model):
    prompt, n = [9707, 11, 1879], 8

    async def answer(link) -> tuple[list[int], list[StepRecord]]:
        target = Target(target_model, ModelWorker(), link, n_ctx=256, settings=SpecSettings())
        seen = Records()
        target.observers.append(seen)
        tokens, _ = await answer_of(target, Request(prompt, SamplingParams(), max_tokens=n))
        return tokens, seen.records

    alone, _ = asyncio.run(answer(None))
    link = InstantDraft(alone)
    tokens, records = asyncio.run(answer(link))
    assert link.opened_with[0] > 0  # the draft is asked to draft from the session's start
    assert records[0].n_verified > 0 and records[0].n_accepted > 0
    assert tokens[:records[0].n_accepted] == alone[:records[0].n_accepted]


def test_a_session_the_draft_refused_is_not_waited_for_in_the_synchronous_mode():
    target, generation, _ = waiting_target_and_generation()
    generation.on_draft_refused()  # the link got a SessionError for it (e.g. the draft's cache is full)

    async def synchronous() -> float:
        began = time.monotonic()
        await target._await_drafts(generation, 4)
        return time.monotonic() - began

    assert asyncio.run(synchronous()) < SYNC_WAIT_S / 2
    generation.open_message()  # a reconnected draft opens the session again: it is waited for again
    assert not generation.draft_refused


def test_while_the_draft_rests_commits_wait_and_then_go_out_in_one_message(target_model):
    prompt, n = [9707, 11, 1879], 14
    link = RecordingDraft()
    # No lookup: free drafts would commit several tokens a step.
    target = Target(target_model, ModelWorker(), link, n_ctx=256, settings=SpecSettings(lookup=False))
    # The draft's switch judges its sessions: resting; a trial comes in 11 steps.
    target.pool.members[0].switch = Switch(speculating=False, steps_left=sw.PROBE_LEAD + 6)

    async def run() -> list[int]:
        return [t async for step, _ in target.generate(Request(prompt, SamplingParams(), max_tokens=n))
                for t in step.tokens]

    tokens = asyncio.run(run())
    commits = [e.commit for e in link.events if isinstance(e, pb.TargetEvent) and e.HasField("commit")]
    # The first steps' tokens wait; the lead into the trial sends them at once, then one commit per step.
    assert commits[0].start == len(prompt) and len(commits[0].tokens) >= 6
    assert all(len(commit.tokens) == 1 for commit in commits[1:])
    assert [t for commit in commits for t in commit.tokens] == tokens[:sum(len(c.tokens) for c in commits)]
    assert len(commits) < n - 4


def test_the_switch_estimates_decoding_alone_at_a_load_from_the_calls_the_target_timed(target_model):
    target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(lookup=False))

    async def run():
        await target.batcher()
        before = target.control.switch.estimate_alone(4)
        async for _ in target.generate(Request([9707, 11, 1879], SamplingParams(), max_tokens=6)):
            pass
        return before

    # Before any step, from the one-token calls timed as the target starts (never from the prior's units of T(1)).
    assert asyncio.run(run()) == pytest.approx(target.control.switch.rest_rates[1] / (1 + 3 * PRIOR_BATCH_SLOPE))
    assert target.control.switch.estimate_alone(1) == pytest.approx(1.0 / target.control.costs.measured_seconds(1))
    assert target.control.switch.estimate_alone(4) == pytest.approx(1.0 / target.control.costs.batch_seconds(4))
