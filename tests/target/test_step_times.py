"""Where a request's decode time goes: its steps' parts (the call's decode and verification, duo's own work, the
waits for drafts, for the batch, and between steps) add up to the time from its first token to its end."""

from __future__ import annotations

import asyncio
import time

import pytest

from duo.bench.step_times import PARTS
from duo.llama.worker import ModelWorker
from duo.net._proto import duo_pb2 as pb
from duo.net.wire import ChainChunk
from duo.sampling.params import SamplingParams
from duo.target.generation import Generation
from duo.target.request import GenerationStats, Request, SpecSettings
from duo.target.target import Target
from helpers.fake_drafts import RecordingDraft
from helpers.generation import generated

PROMPT = [9707, 11, 1879]
BLOCK_S = 0.05  # other work on the model thread in front of a step, or a client slow to take its tokens
ANSWER_S = 0.03  # how long the draft below takes to answer a commit


def greedy(n: int) -> Request:
    return Request(PROMPT, SamplingParams(), max_tokens=n)


def assert_parts_add_up(stats: GenerationStats) -> None:
    times = stats.times
    assert all(getattr(times, part) >= 0 for part in PARTS)
    assert times.decode == pytest.approx(stats.finished_at - stats.first_token_at, rel=1e-9, abs=1e-9)


def test_the_parts_of_the_decode_time_add_up_to_the_time_from_the_first_token_to_the_end(target_model):
    target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings())
    tokens, stats = generated(target, greedy(8))
    assert len(tokens) == 8
    assert_parts_add_up(stats)
    assert stats.times.verify > 0 and stats.times.check > 0 and stats.times.work > 0
    assert stats.times.drafts == 0 and stats.times.round_trips == 0  # no draft: nothing waited for


def test_work_ahead_on_the_model_thread_counts_as_the_queue_and_a_slow_client_as_between_steps(target_model):
    worker = ModelWorker()
    target = Target(target_model, worker, None, n_ctx=256, settings=SpecSettings())

    async def block_then_dawdle(_: GenerationStats) -> None:
        asyncio.ensure_future(worker.run(time.sleep, BLOCK_S))  # the next step waits this long for the model thread
        await asyncio.sleep(BLOCK_S)  # and the client takes as long to come back for it

    tokens, stats = generated(target, greedy(6), block_then_dawdle)
    assert_parts_add_up(stats)
    times = stats.times
    # Five steps after the first token, each behind the client's sleep then BLOCK_S less the sleep on the thread.
    assert times.between >= 5 * BLOCK_S
    assert times.verify + times.check < times.between  # the wait is not counted as model work
    assert times.queue + times.between >= 5 * BLOCK_S


class AnsweringDraft(RecordingDraft):
    """A draft that knows the answer and sends its next tokens ANSWER_S after each commit (none at the opening: the
    first step decodes alone)."""

    def __init__(self, answer: list[int]) -> None:
        super().__init__()
        self.answer = answer
        self.sessions: dict[int, Generation] = {}
        self.epochs = 0

    def register(self, generation: Generation) -> None:
        self.sessions[generation.session_id] = generation

    def unregister(self, session_id: int) -> None:
        self.sessions.pop(session_id, None)

    def send(self, event: pb.TargetEvent) -> None:
        super().send(event)
        if event.HasField("commit") and event.commit.session_id in self.sessions:
            self._answer(self.sessions[event.commit.session_id], event.commit.start + len(event.commit.tokens))

    def _answer(self, generation: Generation, start: int) -> None:
        self.epochs += 1
        tokens = self.answer[start - len(PROMPT):][:4]
        chunk = ChainChunk(epoch=self.epochs, start=start, tokens=tokens, dists=[])
        asyncio.get_running_loop().call_later(ANSWER_S, generation.on_chunk, chunk)


def test_the_wait_for_a_drafts_answer_to_each_commit_counts_as_drafts_and_as_its_round_trip(target_model):
    alone, _ = generated(Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings()), greedy(12))
    # The synchronous loop: each step waits for 2 drafts, which come ANSWER_S after the commit before it.
    target = Target(target_model, ModelWorker(), AnsweringDraft(alone), n_ctx=256,
                    settings=SpecSettings(sync=2, adaptive=False, lookup=False))
    tokens, stats = generated(target, greedy(12))
    assert tokens == alone
    assert_parts_add_up(stats)
    times = stats.times
    steps_after_the_first = stats.verify_steps - 1
    assert steps_after_the_first >= 2
    # Each waited for the answer to the commit sent just before it (the rest of that step ran meanwhile).
    assert times.drafts >= steps_after_the_first * ANSWER_S / 2
    assert times.round_trips >= steps_after_the_first  # the last step's commit is answered after the request ended
    assert times.round_trip >= times.round_trips * ANSWER_S


def test_the_parts_travel_in_the_stats_under_their_proto_names():
    stats = GenerationStats()
    stats.times.add_step(drafts=0.1, work=0.2, queue=0.3, verify=0.4, check=0.5, between=0.6)
    stats.times.round_trips, stats.times.round_trip = 2, 0.07
    message = pb.Stats(**stats.fields(draft_connected=True))
    assert (message.step_drafts_seconds, message.step_work_seconds, message.step_queue_seconds,
            message.step_verify_seconds, message.step_check_seconds, message.step_between_seconds) == pytest.approx(
        (0.1, 0.2, 0.3, 0.4, 0.5, 0.6))
    assert message.commit_round_trips == 2 and message.commit_round_trip_seconds == pytest.approx(0.07)
    assert stats.times.decode == pytest.approx(2.1)
