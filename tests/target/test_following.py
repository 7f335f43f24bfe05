"""Requests that read the same prompt prefix at once read it once (duo.target.following): the later one waits for
the earlier one's cells, as an agent's sub-agents started side by side with one long system prompt would need."""

from __future__ import annotations

import asyncio

import pytest

from duo.llama.model import N_BATCH
from duo.llama.worker import ModelWorker
from duo.sampling.params import SamplingParams
from duo.target.following import Readers
from duo.target.request import GenerationStats, Request, SpecSettings
from duo.target.target import Target
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.held_calls import HOLD_S, HeldCalls

PROMPT = [(7 * i) % 5000 + 100 for i in range(1700)]  # read in chunks of N_BATCH (512, 512, 512), then its end
OWN_END = [(11 * i) % 3000 + 200 for i in range(600)]  # a second request's own part after PROMPT's first 1,100
READ = 3 * N_BATCH  # of PROMPT, what whole chunks read before the first step (alone)


def request(prompt: list[int], cache_prompt: bool = True) -> Request:
    return Request(prompt, SamplingParams(), max_tokens=8, cache_prompt=cache_prompt)


async def answer(target: Target, req: Request, stats: GenerationStats) -> list[int]:
    return [token async for step, _ in target.generate(req, stats) for token in step.tokens]


def readings(chunks: list[tuple[int, int]], below: int) -> set[int]:
    """How many times each position under `below` was read in prompt chunks (a set of the counts seen)."""
    return {sum(pos <= p < pos + n for pos, n in chunks) for p in range(below)}


def side_by_side(target_model, *requests: Request, hold_first_chunk: bool = False, cancel_first: bool = False):
    """Each request's tokens and counters, run at once on one target (two sequences), and the prompt chunks read.
    `hold_first_chunk`: the second starts while the first's first chunk is being read; `cancel_first`: the first is
    cancelled then (its answer: None)."""
    target = Target(target_model, ModelWorker(), None, n_ctx=2048, settings=SpecSettings(), parallel=2)

    async def run():
        try:
            held = HeldCalls((await target.batcher()).context)
            stats = [GenerationStats(prompt_tokens=len(r.prompt_tokens)) for r in requests]
            if hold_first_chunk:
                held.hold(0)
            first = asyncio.ensure_future(answer(target, requests[0], stats[0]))
            if hold_first_chunk:
                assert await asyncio.to_thread(held.reached.wait, HOLD_S)
            second = asyncio.ensure_future(answer(target, requests[1], stats[1]))
            if cancel_first:
                await asyncio.sleep(0.2)  # the second has found what the cache holds and waits on the first's read
                first.cancel()
            held.release()
            answers = await asyncio.gather(first, second, return_exceptions=True)
            return [None if isinstance(a, BaseException) else a for a in answers], stats, held.prompt_chunks()
        finally:
            await target.close()

    return asyncio.run(run())


def test_two_requests_for_one_prompt_at_once_read_each_chunk_once_and_both_answer_as_alone(target_model):
    answers, stats, chunks = side_by_side(target_model, request(PROMPT), request(PROMPT))
    assert readings(chunks, READ) == {1}  # not twice: by the leader alone
    assert sorted(s.cached_prompt_tokens for s in stats)[1] >= READ  # the follower: the leader's cells
    for tokens in answers:
        assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPT, tokens, 8)


def test_a_request_sharing_a_long_prefix_waits_for_it_then_reads_its_own_part(target_model):
    """The second starts while the first's first chunk is read: it adopts that chunk, follows the read through the
    shared 1,100 tokens, and reads its own 600 after them."""
    other = PROMPT[:1100] + OWN_END
    answers, stats, chunks = side_by_side(target_model, request(PROMPT), request(other), hold_first_chunk=True)
    assert readings(chunks, 1100) == {1}  # the shared part read once
    assert sum(n for _, n in chunks) <= len(PROMPT) + len(OWN_END)  # and each one's own part by itself, once
    assert stats[1].cached_prompt_tokens >= 2 * N_BATCH  # what the first had read of the shared part: whole chunks
    assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPT, answers[0], 8)
    assert leaves_greedy_path_only_at_a_near_tie(target_model, other, answers[1], 8)


def test_a_follower_whose_leader_is_cancelled_reads_the_rest_itself(target_model):
    answers, stats, chunks = side_by_side(target_model, request(PROMPT), request(PROMPT), hold_first_chunk=True,
                                          cancel_first=True)
    assert answers[0] is None
    assert stats[1].cached_prompt_tokens >= N_BATCH  # the chunk the leader read before it left
    assert readings(chunks, N_BATCH) == {1}
    assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPT, answers[1], 8)


def test_a_private_request_neither_follows_nor_is_followed(target_model):
    answers, stats, chunks = side_by_side(target_model, request(PROMPT, cache_prompt=False), request(PROMPT))
    assert readings(chunks, READ) == {2}
    assert [s.cached_prompt_tokens for s in stats] == [0, 0]
    for tokens in answers:
        assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPT, tokens, 8)


class Held:
    """A context's held tokens by sequence, and its n_batch: what Readers reads of it."""

    n_batch = 4

    def __init__(self) -> None:
        self.cells: dict[int, list[int]] = {}

    def held(self, seq: int) -> list[int]:
        return self.cells.setdefault(seq, [])


@pytest.mark.parametrize("pos, expected", [(0, (1, 10)), (6, (1, 10)), (7, None)])
def test_the_leader_is_the_earlier_read_sharing_most_at_least_a_call_ahead(pos, expected):
    readers = Readers(Held())
    readers.start(0, list(range(8)) + [99, 99])  # shares 8 with the prompt below
    readers.start(1, list(range(10)))  # shares all 10
    readers.start(2, list(range(12)))
    readers.start(3, list(range(12)))  # later than 2: never its leader
    assert readers.leader(2, list(range(10)), pos) == expected
    assert readers.leader(0, list(range(10)), 0) is None  # the first read follows no one
    assert readers.leader(4, list(range(10)), 0) is None  # not reading


def test_a_follower_waits_for_the_leaders_cells_or_the_end_of_its_read():
    context = Held()
    readers = Readers(context)
    readers.start(0, list(range(10)))
    readers.start(1, list(range(10)))

    async def waits():
        waiting = asyncio.ensure_future(readers.follow(0, 10))
        context.cells[0] = list(range(5))
        readers.progressed()
        await asyncio.sleep(0)
        halfway = waiting.done()
        context.cells[0] = list(range(10))
        readers.progressed()
        await asyncio.wait_for(waiting, 1)
        stopped = asyncio.ensure_future(readers.follow(0, 20))  # more than it will ever hold: its read's end frees it
        await asyncio.sleep(0)
        readers.stop(0)
        await asyncio.wait_for(stopped, 1)
        return halfway

    assert asyncio.run(waits()) is False
