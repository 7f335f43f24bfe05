"""The prompt and answer the penalty tests read."""

from __future__ import annotations

import asyncio

from duo.llama.worker import ModelWorker
from duo.sampling.ops.penalties import Penalties
from duo.sampling.params import SamplingParams
from duo.target.request import Request, SpecSettings, StepRecord
from duo.target.target import Target


PROMPT_TEXT = "Once upon a time"


def answer(model, prompt: list[int], penalties: Penalties, link=None, n: int = 24) -> tuple[list[int], list]:
    async def run():
        target = Target(model, ModelWorker(), link, n_ctx=256, settings=SpecSettings(draft_max=8, adaptive=False))
        records: list[StepRecord] = []
        target.observers.append(type("R", (), {"on_step": lambda self, r: records.append(r)})())
        request = Request(prompt, SamplingParams(), max_tokens=n, penalties=penalties)
        return [t async for step, _ in target.generate(request) for t in step.tokens], records

    return asyncio.run(run())
