"""The model thread's resource helpers: whatever is cancelled when, what was made gets closed."""

from __future__ import annotations

import asyncio
import threading

import pytest

from duo.runtime import ModelWorker

WAIT_S = 5.0


class Resource:
    """Stands for a llama context: made and closed on the model thread."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        self.closes = 0

    def close(self) -> None:
        self.closes += 1
        self.closed.set()


class Factory:
    """Makes Resources; with `hold`, each creation signals `creating` and then waits for `proceed`."""

    def __init__(self, *, hold: bool = False) -> None:
        self.made: list[Resource] = []
        self.hold = hold
        self.creating, self.proceed = threading.Event(), threading.Event()

    def __call__(self) -> Resource:
        self.creating.set()
        if self.hold:
            assert self.proceed.wait(WAIT_S)
        self.made.append(Resource())
        return self.made[-1]


async def set_soon(event: threading.Event) -> None:
    """Wait, without blocking the event loop, until another thread sets `event`."""
    assert await asyncio.to_thread(event.wait, WAIT_S)


def occupy(worker: ModelWorker) -> tuple[threading.Event, threading.Event]:
    """Another request's model call: it holds the model thread until `release` is set; `busy` once it runs."""
    busy, release = threading.Event(), threading.Event()
    worker._executor.submit(lambda: (busy.set(), release.wait(WAIT_S)))
    return busy, release


async def cancelled(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_resource_whose_creation_was_cancelled_midway_is_closed_once_made():
    factory = Factory(hold=True)

    async def scenario() -> None:
        worker = ModelWorker()

        task = asyncio.create_task(worker.create(factory))
        await set_soon(factory.creating)
        await cancelled(task)  # the client left while its context was being made
        factory.proceed.set()
        await worker.run(lambda: None)  # the creation has finished

    asyncio.run(scenario())
    [resource] = factory.made
    assert resource.closed.wait(WAIT_S) and resource.closes == 1


def test_a_creation_cancelled_before_its_turn_on_the_model_thread_never_runs():
    factory = Factory()

    async def scenario() -> None:
        worker = ModelWorker()
        busy, release = occupy(worker)
        await set_soon(busy)
        task = asyncio.create_task(worker.create(factory))
        await asyncio.sleep(0.05)  # the creation waits its turn
        await cancelled(task)
        release.set()
        await worker.run(lambda: None)  # everything queued before this has run

    asyncio.run(scenario())
    assert factory.made == []


def test_a_close_cancelled_while_waiting_for_the_model_thread_still_runs():
    factory = Factory()

    async def scenario() -> None:
        worker = ModelWorker()
        occupied: asyncio.Future[tuple[threading.Event, threading.Event]] = asyncio.Future()

        async def use() -> None:
            resource = await worker.create(factory)
            occupied.set_result(occupy(worker))  # the close must wait behind this call
            await worker.close(resource)

        task = asyncio.create_task(use())
        busy, release = await occupied
        await set_soon(busy)
        await asyncio.sleep(0.05)  # the task now waits for its close to get a turn
        await cancelled(task)
        release.set()

    asyncio.run(scenario())
    [resource] = factory.made
    assert resource.closed.wait(WAIT_S) and resource.closes == 1
