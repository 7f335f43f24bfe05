"""A request with cache_prompt false shares its prompt with no other request, either way: none starts from its
cells while it runs, nor after it ended (README, "Who shares with whom")."""

from __future__ import annotations

import asyncio

from duo.llama.worker import ModelWorker
from duo.sampling.params import SamplingParams
from duo.target.target import Target
from duo.target.request import Request, SpecSettings
from helpers.prompts import SYSTEM

PROMPT = SYSTEM + [7985, 264, 1140]


def cached_beside_a_running_request(target_model, first_caches: bool) -> int:
    """The prompt tokens a request takes from the cache while a first request with the same prompt (and
    cache_prompt `first_caches`) runs: held open after its first step, its sequence holds that prompt."""
    target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(), parallel=2)

    async def overlapping() -> int:
        first = target.generate(Request(PROMPT, SamplingParams(), max_tokens=40, cache_prompt=first_caches))
        try:
            await anext(first)
            stats = None
            async for _, stats in target.generate(Request(PROMPT, SamplingParams(), max_tokens=4)):
                pass
            return stats.cached_prompt_tokens
        finally:
            await first.aclose()
            await target.close()

    return asyncio.run(overlapping())


def test_a_running_private_requests_prompt_is_no_prefix_for_another_request(target_model):
    assert cached_beside_a_running_request(target_model, first_caches=False) == 0


def test_a_running_shared_requests_prompt_is_a_prefix_for_another_request(target_model):
    # The prompt but its last token, which the request's first step decodes.
    assert cached_beside_a_running_request(target_model, first_caches=True) == len(PROMPT) - 1


def test_a_private_requests_prompt_is_no_prefix_after_it_ended(target_model):
    target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(), parallel=2)

    async def in_turns() -> int:
        try:
            for cache_prompt in (False, True):
                async for _, stats in target.generate(Request(PROMPT, SamplingParams(), max_tokens=4,
                                                              cache_prompt=cache_prompt)):
                    pass
            return stats.cached_prompt_tokens
        finally:
            await target.close()

    assert asyncio.run(in_turns()) == 0
