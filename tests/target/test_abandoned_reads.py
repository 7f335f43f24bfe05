"""A request cancelled while its prompt is read: the read stops after the chunk in flight, every chunk read stays in
the cache for the same prompt's next request, and the cancelled request's counters say what it found there."""

from __future__ import annotations

import asyncio

from duo.llama.model import N_BATCH
from duo.llama.worker import ModelWorker
from duo.sampling.params import SamplingParams
from duo.target.request import GenerationStats, Request, SpecSettings
from duo.target.target import Target
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.held_calls import HOLD_S, HeldCalls

PROMPT = [(7 * i) % 5000 + 100 for i in range(1700)]  # read in chunks of N_BATCH (512, 512, 512), then its end
END = (len(PROMPT) - 1) % N_BATCH  # the prompt's end, read in the first step (alone: what whole chunks leave over)


def request() -> Request:
    return Request(PROMPT, SamplingParams(), max_tokens=8)


async def tokens_of(target: Target, stats: GenerationStats) -> list[int]:
    return [token async for step, _ in target.generate(request(), stats) for token in step.tokens]


async def cancelled_during_the_read(target: Target, held: HeldCalls, after: int) -> GenerationStats:
    """A request for PROMPT cancelled while the prompt chunk after `after` more is decoded (let go once it ended)."""
    stats = GenerationStats(prompt_tokens=len(PROMPT))
    held.hold(after)
    task = asyncio.ensure_future(tokens_of(target, stats))
    assert await asyncio.to_thread(held.reached.wait, HOLD_S)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    held.release()
    return stats


def test_a_cancelled_read_keeps_its_chunks_for_the_next_request_and_its_counters_say_what_it_found(target_model):
    target = Target(target_model, ModelWorker(), None, n_ctx=2048, settings=SpecSettings(), parallel=2)

    async def three_tries():
        try:
            held = HeldCalls((await target.batcher()).context)
            first = await cancelled_during_the_read(target, held, after=1)
            chunks_of_first = held.prompt_chunks()
            second = await cancelled_during_the_read(target, held, after=0)
            last = GenerationStats(prompt_tokens=len(PROMPT))
            return first, chunks_of_first, second, last, await tokens_of(target, last), held.prompt_chunks()
        finally:
            await target.close()

    first, chunks_of_first, second, last, tokens, chunks = asyncio.run(three_tries())
    assert chunks_of_first == [(0, N_BATCH), (N_BATCH, N_BATCH)]  # no chunk after the one in flight
    assert chunks == [*chunks_of_first, (2 * N_BATCH, N_BATCH)]  # each read once
    assert [first.cached_prompt_tokens, second.cached_prompt_tokens] == [0, 2 * N_BATCH]
    assert last.cached_prompt_tokens == len(PROMPT) - 1 - END and last.generated_tokens == len(tokens)
    assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPT, tokens, 8)
