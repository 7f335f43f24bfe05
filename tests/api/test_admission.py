"""Admission: N run at once, the next M wait in arrival order, the rest are refused at once."""

from __future__ import annotations

import asyncio

import pytest

from duo.api.serving.admit import Admission, QueueFull


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=5))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_up_to_parallel_requests_are_admitted_at_once():
    async def scenario():
        admission = Admission(parallel=2, queue_size=0)
        await admission.acquire()
        await admission.acquire()
        assert admission.running == 2
        with pytest.raises(QueueFull, match="busy"):
            await admission.acquire()

    run(scenario())


def test_waiting_requests_are_admitted_in_arrival_order():
    async def scenario():
        admission = Admission(parallel=1, queue_size=3)
        first = await admission.acquire()
        order: list[int] = []

        async def wait(i: int) -> None:
            slot = await admission.acquire()
            order.append(i)
            await asyncio.sleep(0)
            slot.release()

        tasks = [asyncio.create_task(wait(i)) for i in range(3)]
        await settle()
        assert admission.waiting == 3 and order == []
        first.release()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2]
        assert admission.running == 0 and admission.waiting == 0

    run(scenario())


def test_past_the_queue_bound_a_request_is_refused_without_waiting():
    async def scenario():
        admission = Admission(parallel=1, queue_size=1)
        await admission.acquire()
        waiter = asyncio.create_task(admission.acquire())
        await settle()
        with pytest.raises(QueueFull):
            await admission.acquire()
        waiter.cancel()

    run(scenario())


def test_a_released_place_goes_to_the_waiting_request_not_to_a_newcomer():
    async def scenario():
        admission = Admission(parallel=1, queue_size=1)
        slot = await admission.acquire()
        waiter = asyncio.create_task(admission.acquire())
        await settle()
        slot.release()
        # A newcomer arriving before the waiter runs again must queue behind it, not take its place.
        newcomer = asyncio.create_task(admission.acquire())
        await settle()
        assert waiter.done() and not newcomer.done()
        assert admission.running == 1 and admission.waiting == 1
        newcomer.cancel()

    run(scenario())


def test_a_waiter_that_gives_up_frees_its_place_in_the_queue():
    async def scenario():
        admission = Admission(parallel=1, queue_size=1)
        slot = await admission.acquire()
        waiter = asyncio.create_task(admission.acquire())
        await settle()
        waiter.cancel()
        await settle()
        assert admission.waiting == 0
        slot.release()
        assert admission.running == 0
        await admission.acquire()

    run(scenario())


def test_a_place_handed_to_a_waiter_that_just_gave_up_is_passed_on():
    async def scenario():
        admission = Admission(parallel=1, queue_size=2)
        slot = await admission.acquire()
        quitter = asyncio.create_task(admission.acquire())
        patient = asyncio.create_task(admission.acquire())
        await settle()
        slot.release()    # hands the place to `quitter`...
        quitter.cancel()  # ...which is cancelled before it runs again
        await settle()
        assert quitter.cancelled()
        assert (await patient) is not None and admission.running == 1

    run(scenario())


def test_releasing_a_slot_twice_frees_one_place():
    async def scenario():
        admission = Admission(parallel=2, queue_size=0)
        slot = await admission.acquire()
        await admission.acquire()
        slot.release()
        slot.release()
        assert admission.running == 1

    run(scenario())


def test_nonsense_limits_are_refused():
    with pytest.raises(ValueError):
        Admission(parallel=0, queue_size=1)
    with pytest.raises(ValueError):
        Admission(parallel=1, queue_size=-1)
