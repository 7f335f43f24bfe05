"""The target's steps as its adaptive policy sees them: the model work alone."""

from __future__ import annotations

import asyncio
import time

import pytest

from duo.model import Model
from duo.runtime import ModelWorker
from duo.sampling import SamplingParams
from duo.target import Request, SpecSettings, StepRecord, Target

BLOCK_S = 0.15  # another request's work on the model thread, in front of every step


@pytest.fixture(scope="module")
def target_model(tiny_target):
    model = Model(tiny_target, device="cpu", threads=1)
    yield model
    model.close()


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
    assert target.costs.batch_seconds(1) < BLOCK_S / 2

