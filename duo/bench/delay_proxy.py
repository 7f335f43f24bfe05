"""A TCP forwarder that delays every byte by a fixed time in each direction: a network's latency, for the bench.

Each chunk read from one side is stamped with its arrival time and delivered to the other side at
arrival + delay, in order. A queue per direction decouples reading from delivering, so the delay
does not add up over chunks and the link's throughput is not limited: chunks read 1 ms apart are
delivered 1 ms apart, each exactly `delay` late (a serial read-sleep-write loop would make the
n-th chunk n delays late).

    python duo/bench/delay_proxy.py --listen 127.0.0.1:7170 --upstream 127.0.0.1:7070 --delay-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Awaitable

_READ_SIZE = 1 << 16


async def start_delay_proxy(upstream: tuple[str, int], delay_s: float,
                            listen: tuple[str, int] = ("127.0.0.1", 0)) -> asyncio.Server:
    """Listen on `listen` (port 0: any free port) and forward each connection to `upstream`,
    delaying both directions by `delay_s`."""

    async def connect(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        await _forward(client_reader, client_writer, upstream, delay_s)

    return await asyncio.start_server(connect, *listen)


async def _forward(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter,
                   upstream: tuple[str, int], delay_s: float) -> None:
    """One client connection: open its own upstream connection and pump both ways until both end."""
    try:
        upstream_reader, upstream_writer = await asyncio.open_connection(*upstream)
    except OSError:
        # Nothing to forward to: the client sees its connection closed, as with a refused one.
        client_writer.close()
        return
    try:
        await _together(_pipe(client_reader, upstream_writer, delay_s),
                        _pipe(upstream_reader, client_writer, delay_s))
    except ConnectionError:
        pass  # one side reset the connection: close both, as a real link would end
    finally:
        client_writer.close()
        upstream_writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """One direction: everything `reader` gives, `delay_s` later to `writer`; its end passes on as EOF."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    await _together(_receive(reader, queue, delay_s), _deliver(queue, writer))


async def _receive(reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]], delay_s: float) -> None:
    """Stamp each chunk with the time it is due; b"" (the end of the stream) is queued last."""
    loop = asyncio.get_running_loop()
    while True:
        chunk = await reader.read(_READ_SIZE)
        queue.put_nowait((loop.time() + delay_s, chunk))
        if not chunk:
            return


async def _deliver(queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
    """Write each chunk at its due time. Due times only grow, so waiting for one never delays a later one."""
    loop = asyncio.get_running_loop()
    while True:
        due, chunk = await queue.get()
        if due > loop.time():
            await asyncio.sleep(due - loop.time())
        if not chunk:
            # Half-close: the other side learns this direction ended and may still answer.
            if writer.can_write_eof():
                writer.write_eof()
            return
        writer.write(chunk)
        await writer.drain()


async def _together(*steps: Awaitable[None]) -> None:
    """Run `steps` concurrently until all end; the first to fail cancels the others and raises."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _serve(args: argparse.Namespace) -> None:
    server = await start_delay_proxy(args.upstream, args.delay_ms / 1000, args.listen)
    print(f"delay proxy {args.listen[0]}:{args.listen[1]} -> {args.upstream[0]}:{args.upstream[1]}, "
          f"{args.delay_ms:g} ms each way", file=sys.stderr, flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", type=_address, required=True, help="HOST:PORT to accept connections on")
    parser.add_argument("--upstream", type=_address, required=True, help="HOST:PORT to forward them to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay in milliseconds")
    asyncio.run(_serve(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
