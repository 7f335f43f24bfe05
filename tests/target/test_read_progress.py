"""A prompt's read told as it goes (llama-server's return_progress): once the cache's prefix is known, then after each
read call of n_batch tokens, the last just before the first token; nothing told where it was not asked."""

from __future__ import annotations

import asyncio
import math

from duo.llama.worker import ModelWorker
from duo.sampling.params import SamplingParams
from duo.target.progress import ReadProgress
from duo.target.request import Request, SpecSettings
from duo.target.target import Target
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie

N_BATCH = 64
PROMPT = [(11 * i) % 3000 + 200 for i in range(200)]  # read in calls of 64, 64, 64, then 8 with the first token


def read(target: Target, prompt: list[int], progress: bool) -> tuple[list[ReadProgress | list[int]], list[int]]:
    """What target.generate yields for a greedy request for `prompt` (each step as its tokens), and the tokens."""
    async def one():
        return [item if isinstance(item, ReadProgress) else item.tokens
                async for item, _ in target.generate(Request(prompt, SamplingParams(), max_tokens=6), None,
                                                     progress)]

    items = asyncio.run(one())
    return items, [token for item in items if not isinstance(item, ReadProgress) for token in item]


def reads(target: Target, prompt: list[int], *asked: bool) -> list[tuple[list[ReadProgress | list[int]], list[int]]]:
    """`read` of `prompt` once per entry of `asked` (whether that read asks for progress), one after the other on
    `target`, which is closed after them."""
    try:
        return [read(target, prompt, progress) for progress in asked]
    finally:
        asyncio.run(target.close())


def alone(target_model, **settings) -> Target:
    return Target(target_model, ModelWorker(), None, n_ctx=1024, settings=SpecSettings(lookup=False, **settings),
                  n_batch=N_BATCH)


def test_a_prompt_read_alone_is_told_before_its_first_call_then_after_each_of_n_batch_tokens(target_model):
    [(items, tokens)] = reads(alone(target_model), PROMPT, True)
    told = [item for item in items if isinstance(item, ReadProgress)]
    assert items[:len(told)] == told  # every report before the first token
    # llama-server's count: one before the read, then one a call of n_batch tokens (the last with the first token)
    assert len(told) == 1 + math.ceil(len(PROMPT) / N_BATCH)
    assert [progress.processed for progress in told] == [0, 64, 128, 192, len(PROMPT)]
    assert {(progress.total, progress.cache) for progress in told} == {(len(PROMPT), 0)}
    assert told[0].read_seconds == 0 and told[0].read == 0
    assert all(later.read_seconds >= earlier.read_seconds for earlier, later in zip(told, told[1:]))
    assert told[-1].read_seconds > 0
    assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPT, tokens, 6)


def test_a_prompt_found_in_the_cache_is_told_with_its_cache_and_then_its_end(target_model):
    (_, first), (items, again) = reads(alone(target_model), PROMPT, False, True)
    told = [item for item in items if isinstance(item, ReadProgress)]
    cached = len(PROMPT) - 1  # the last token is read with the first step
    assert [(p.cache, p.processed) for p in told] == [(cached, cached), (cached, len(PROMPT))]
    assert again == first


def test_a_read_that_did_not_ask_is_not_told(target_model):
    [(items, _)] = reads(alone(target_model), PROMPT, False)
    assert not any(isinstance(item, ReadProgress) for item in items)


def test_a_batch_smaller_than_the_draft_length_reads_and_verifies_within_it(target_model):
    target = Target(target_model, ModelWorker(), None, n_ctx=1024, settings=SpecSettings(draft_max=16), n_batch=8)
    [(items, tokens)] = reads(target, PROMPT[:50], True)
    told = [item.processed for item in items if isinstance(item, ReadProgress)]
    assert told == [0, 8, 16, 24, 32, 40, 48, 50]
    assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPT[:50], tokens, 6)


def test_requests_read_beside_each_other_in_calls_smaller_than_a_prompt_chunk(target_model):
    target = Target(target_model, ModelWorker(), None, n_ctx=512, settings=SpecSettings(), parallel=2, n_batch=8)

    async def both():
        async def tokens(prompt: list[int]) -> list[int]:
            request = Request(prompt, SamplingParams(), max_tokens=6)
            return [token async for step, _ in target.generate(request) for token in step.tokens]
        try:
            return await asyncio.gather(tokens(PROMPT[:60]), tokens(PROMPT[60:130]))
        finally:
            await target.close()

    for prompt, got in zip((PROMPT[:60], PROMPT[60:130]), asyncio.run(both())):
        assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, got, 6)
