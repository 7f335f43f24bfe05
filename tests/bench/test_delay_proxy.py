"""duo/bench/delay_proxy.py: each direction delayed by D, bytes intact and in order, throughput not serialized."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Awaitable, Callable

from duo.bench import delay_proxy


# Scheduling slack: the best of several round trips on a loaded 2-core machine; the delays tested are
# several times larger.
SLACK_S = 0.04


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while chunk := await reader.read(1 << 16):
        writer.write(chunk)
        await writer.drain()
    writer.close()


async def _through_proxy(delay_s: float, test: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) -> None:
    """Run `test` on a connection to an echo server behind a proxy that delays by `delay_s`."""
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    proxy = await delay_proxy.start_delay_proxy(echo.sockets[0].getsockname()[:2], delay_s)
    reader, writer = await asyncio.open_connection(*proxy.sockets[0].getsockname()[:2])
    try:
        await test(reader, writer)
    finally:
        writer.close()
        proxy.close()
        echo.close()


def test_a_round_trip_takes_twice_the_delay():
    delay = 0.05

    async def test(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        trips = []
        for _ in range(5):
            began = time.perf_counter()
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
            trips.append(time.perf_counter() - began)
        # Every trip waits the delay both ways; load can only add to a trip, so the best one shows that
        # the proxy itself adds nothing more.
        assert all(trip >= 2 * delay for trip in trips) and min(trips) < 2 * delay + SLACK_S, trips

    asyncio.run(_through_proxy(delay, test))


def test_a_large_transfer_arrives_intact_and_in_order():
    data = os.urandom(8 << 20)

    async def test(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def send() -> None:
            for i in range(0, len(data), 100_000):  # many writes, so many chunks in flight
                writer.write(data[i:i + 100_000])
                await writer.drain()

        sending = asyncio.create_task(send())
        assert await reader.readexactly(len(data)) == data
        await sending

    asyncio.run(_through_proxy(0.005, test))


def test_messages_sent_together_are_each_delayed_once_not_one_after_another():
    delay, count = 0.05, 50

    async def test(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sent = []
        for i in range(count):  # 1 ms apart, so the proxy reads them as separate chunks
            sent.append(time.perf_counter())
            writer.write(b"%04d" % i)
            await writer.drain()
            await asyncio.sleep(0.001)
        for i in range(count):
            assert await reader.readexactly(4) == b"%04d" % i
        # Serialized delays would bring the last echo 50 delays late; here it is one round trip late.
        assert time.perf_counter() - sent[-1] < 2 * delay + SLACK_S

    asyncio.run(_through_proxy(delay, test))


def test_closing_one_side_passes_on_as_end_of_stream():
    async def test(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"last words")
        writer.write_eof()  # the echo server answers, sees the end, closes; the proxy passes both on
        assert await asyncio.wait_for(reader.read(), 5) == b"last words"

    asyncio.run(_through_proxy(0.01, test))


def test_a_client_of_an_unreachable_upstream_is_disconnected():
    async def run() -> bytes:
        async with await asyncio.start_server(_echo, "127.0.0.1", 0) as gone:
            address = gone.sockets[0].getsockname()[:2]
        proxy = await delay_proxy.start_delay_proxy(address, 0.01)
        reader, writer = await asyncio.open_connection(*proxy.sockets[0].getsockname()[:2])
        try:
            return await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()
            proxy.close()

    assert asyncio.run(run()) == b""
