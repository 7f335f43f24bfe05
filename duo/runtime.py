"""Process plumbing shared by duo-draft and duo-target: the model thread, gRPC options, event loop, logging."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, TypeVar

import grpc

T = TypeVar("T")

# The vocabulary in the handshake is a few MB; chains and commits are tiny.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Pings every 10 s find a peer that vanished without closing its socket (power loss, cable).
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000


class ModelWorker:
    """Runs model calls one at a time on a dedicated thread, so the event loop keeps serving while a
    model computes (llama.cpp releases the GIL inside decode)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


def grpc_server_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Accept the client's keepalive pings, also between calls, instead of answering GOAWAY.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def grpc_channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnection is ours (duo.link backs off itself); keep grpc's own backoff short.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


async def run_server(server: grpc.aio.Server, address: str, banner: str,
                     background: Callable[[], Awaitable[None]] | None = None) -> None:
    """Start `server` on `address`, run `background` beside it, stop cleanly on SIGINT/SIGTERM."""
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"cannot listen on {address}: address in use or invalid")
    await server.start()
    logging.getLogger("duo").info(banner)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.create_task(background()) if background else None
    await stop.wait()
    if task:
        task.cancel()
    await server.stop(grace=2)


def run_async(main: Awaitable[None]) -> int:
    """Run `main` on uvloop when available."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
    return 0


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
