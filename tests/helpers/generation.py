"""A target's answer to one request, generated in this process: its tokens and the stats it ends with."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from duo.target.request import GenerationStats, Request
from duo.target.target import Target


async def answer_of(target: Target, request: Request,
                    after_step: Callable[[GenerationStats], Awaitable[None]] | None = None,
                    ) -> tuple[list[int], GenerationStats]:
    """The tokens `target` answers `request` with and its stats at the end; `after_step(stats)` is awaited after each
    step (a client slow to come back, a test that reads the stats as they grow)."""
    tokens, stats = [], None
    async for step, stats in target.generate(request):
        tokens += step.tokens
        if after_step is not None:
            await after_step(stats)
    assert stats is not None, "the generation gave no step"
    return tokens, stats


def generated(target: Target, request: Request,
              after_step: Callable[[GenerationStats], Awaitable[None]] | None = None,
              ) -> tuple[list[int], GenerationStats]:
    """answer_of, run to its end in an event loop of its own."""
    return asyncio.run(answer_of(target, request, after_step))
