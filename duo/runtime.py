"""Process plumbing shared by duo-draft and duo-target: flags, the model thread, gRPC and HTTP serving, logging."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import asyncio
import logging
import random
import signal
import socket
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Awaitable, Callable, Protocol, Sequence, TypeVar

import grpc
import uvicorn
from prometheus_client import CollectorRegistry, make_asgi_app

from duo.backends import DEVICES
from duo.model import ModelError
from duo.rpc import check_reachable, parse_endpoints, parse_tensor_split, rpc_arguments

T = TypeVar("T")
R = TypeVar("R", bound="Closeable")

log = logging.getLogger("duo.runtime")

# The vocabulary in the handshake is a few MB; chains and commits are tiny.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Pings every 10 s find a peer that vanished without closing its socket (power loss, cable).
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
# A streaming client that takes nothing for this long is dropped (duo-target --write-timeout): else one
# that stops reading holds its running place, its context and its draft session forever.
WRITE_TIMEOUT_S = 30.0


def add_process_arguments(parser: argparse.ArgumentParser, *, model: str | None, listen: str, serves: str, per: str,
                          model_default: str = "") -> None:
    """The flags duo-draft and duo-target share: the model (by default the catalog's `model`, or None: the program
    picks it, as `model_default` says) and where it runs, the listening address (serving `serves`), a context of
    --ctx-size for each `per`, TLS and the log level."""
    parser.add_argument("--model", default=model,
                        help=f"GGUF path or a name from `duo models list` (default: {model_default or model}, once "
                             "`duo models pull` has fetched it)")
    parser.add_argument("--listen", default=listen, help=f"HOST:PORT to serve {serves} on")
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="where to run the model (a GPU this build cannot use is an error)")
    parser.add_argument("--gpu-layers", type=int, default=None, help="layers to offload (default: all)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--ctx-size", type=int, default=4096, help=f"context size per {per}")
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help=f"serve {serves} over TLS with this PEM certificate (chain)")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="the PEM private key of --tls-cert")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="how much to log (any case): INFO logs one line per request on the target")
    rpc_arguments(parser)


def host_port(value: str, flag: str, *, listening: bool = False) -> tuple[str, int]:
    """(host, port) of a HOST:PORT flag; ValueError saying what to write instead (gRPC takes no scheme).
    An address to listen on may take port 0: the system picks a free one."""
    if "://" in value:
        scheme, _, rest = value.partition("://")
        raise ValueError(f"{flag} takes HOST:PORT without a scheme: write {rest.rstrip('/')!r}, not {value!r} "
                         f"(gRPC, not {scheme})")
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not (0 if listening else 1) <= int(port) < 65536:
        raise ValueError(f"{flag}: {value!r} is not HOST:PORT (e.g. 192.168.1.20:7070; the port is 1-65535)")
    return host.strip("[]"), int(port)


def cannot_listen(address: str, why: str) -> str:
    return f"cannot listen on {address}: {why}; choose another with --listen"


def check_can_listen(address: str) -> None:
    """ValueError if `address` cannot be listened on now (in use, not this machine's): checked before a
    model loads for a minute only to find its port taken. A bind without SO_REUSEPORT, as grpc's is now."""
    host, port = host_port(address, "--listen", listening=True)
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            # As servers bind: past connections of a stopped process (TIME_WAIT) do not hold the port.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as error:
        reason = "the address is in use (another duo process?)" if error.errno == errno.EADDRINUSE else (
            error.strerror or str(error))
        raise ValueError(cannot_listen(address, reason)) from None


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (localhost, 127.x, ::1)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """duo.model.Model's keyword arguments from add_process_arguments' flags. ValueError for a bad flag,
    ModelError naming an --rpc server that does not answer (checked here, before anything starts)."""
    rpc = parse_endpoints(args.rpc) if args.rpc else []
    if args.tensor_split and not rpc:
        raise ValueError("--tensor-split splits the layers over --rpc servers: give --rpc too")
    split = parse_tensor_split(args.tensor_split, len(rpc))
    if rpc:
        check_reachable(rpc)
    return {"device": args.device, "n_gpu_layers": args.gpu_layers, "threads": args.threads, "rpc": rpc,
            "tensor_split": split}


class Closeable(Protocol):
    """A native resource, such as a llama context."""

    def close(self) -> None: ...


class ModelWorker:
    """Runs model calls one at a time on a dedicated thread, so the event loop keeps serving while a
    model computes (llama.cpp releases the GIL inside decode)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._waiting: set[asyncio.Future[Any]] = set()
        self.broken: str | None = None  # why the model can no longer run, once it cannot

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.broken:
            raise ModelError(self.broken)
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        self._waiting.add(future)
        try:
            return await future
        finally:
            self._waiting.discard(future)

    def break_down(self, message: str) -> None:
        """The model can run no more (llama.cpp lost an RPC server and is about to abort the process):
        fail the calls waiting for it, whose thread never returns, and every later call with `message`."""
        self.broken = message
        for future in self._waiting:
            if not future.done():
                future.set_exception(ModelError(message))

    async def create(self, factory: Callable[..., R], *args: Any) -> R:
        """`factory(*args)` on the model thread. A caller cancelled meanwhile never sees the result, so
        it is closed as soon as it is made (a native resource would otherwise live as long as its model)."""
        if self.broken:
            raise ModelError(self.broken)
        made: Future[R] = self._executor.submit(factory, *args)
        try:
            return await asyncio.shield(asyncio.wrap_future(made))
        except asyncio.CancelledError:
            if not made.cancel():  # already running (or done): it will exist
                made.add_done_callback(self._close_orphan)
            raise

    async def close(self, resource: Closeable) -> None:
        """`resource.close()` on the model thread; it runs to the end even if the caller is cancelled
        (a cancelled call still waiting its turn on the thread would otherwise never run). Once the model
        is broken its thread never returns: nothing is closed, the process is ending."""
        if self.broken:
            return
        await asyncio.shield(asyncio.get_running_loop().run_in_executor(self._executor, resource.close))

    def _close_orphan(self, made: Future[Closeable]) -> None:
        if made.exception() is None:
            closing = self._executor.submit(made.result().close)
            closing.add_done_callback(_log_close_failure)


def _log_close_failure(closing: Future[None]) -> None:
    if closing.exception() is not None:
        log.error("closing a resource nobody waited for failed", exc_info=closing.exception())


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """fn(*args) and the seconds it took; run it on the model thread (ModelWorker.run(timed, fn, ...))
    so that the wait behind other model calls is not counted."""
    began = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - began


async def within(awaitable: Awaitable[T], seconds: float) -> T:
    """`awaitable`'s result, or asyncio.TimeoutError after `seconds` (the awaitable is then cancelled).

    asyncio.wait_for up to Python 3.11 swallows a cancellation of the waiting task when the awaitable completes
    in the same turn of the loop (CPython gh-86296): the task goes on as if never cancelled. The link's writer
    did exactly that, and a DraftLink being cancelled then waited forever for it. asyncio.wait never swallows it.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    finally:
        if not task.done():  # timed out, or this task was cancelled: the awaitable goes too
            task.cancel()
        # Where this task is cancelled, the awaitable may still end with an error of its own (a call's stream ending
        # as it is cancelled) that nobody reads below: read it, so that asyncio does not log it as never retrieved.
        task.add_done_callback(lambda ended: ended.cancelled() or ended.exception())
    if not done:
        await asyncio.wait({task})  # cancelled for good before saying so
        raise asyncio.TimeoutError(f"not done within {seconds:g} s")
    return task.result()


class WriteTimeout(Exception):
    """The peer took none of a message for the write timeout: it stopped reading."""


async def write_within(write: Awaitable[None], timeout: float) -> None:
    """Await `write` (a send that waits while the peer's buffers are full), or raise WriteTimeout."""
    try:
        await within(write, timeout)
    except asyncio.TimeoutError:
        raise WriteTimeout(f"the client read nothing for {timeout:g} s (duo-target --write-timeout)") from None


# A peer that went away (a draft, or a target a draft joins) is dialed again after a jittered backoff that doubles
# from RECONNECT_FIRST_S to RECONNECT_MAX_S, and quickly again after a connection that lasted.
RECONNECT_FIRST_S = 0.2
RECONNECT_MAX_S = 2.0


# While a peer cannot be reached, its dialer says so at the first failure, then this often.
UNREACHABLE_LOG_EVERY_S = 60.0


class Unreachable:
    """When a peer that cannot be reached is worth a log line: at its first failure since it was last up, then every
    UNREACHABLE_LOG_EVERY_S while it lasts (a peer on loopback, or behind a firewall, fails every few seconds)."""

    def __init__(self) -> None:
        self.since: float | None = None  # the first failure since the peer was last up
        self.logged_at = 0.0

    def reached(self) -> None:
        self.since = None

    def seconds_to_log(self) -> float | None:
        """A failure now: how long the peer has been unreachable, when a line is due; None when it is not."""
        now = asyncio.get_running_loop().time()
        if self.since is None:
            self.since = now
        elif now - self.logged_at < UNREACHABLE_LOG_EVERY_S:
            return None
        self.logged_at = now
        return now - self.since


async def keep_reconnecting(connect_once: Callable[[], Awaitable[None]], on_bug: Callable[[Exception], None],
                            refused: Callable[[], bool], refused_retry_s: float,
                            running: Callable[[], bool] = lambda: True) -> None:
    """Run `connect_once` again and again while `running()`, backing off between tries; while `refused()` (the peer
    refused this pair: it may be restarted with the right model) every `refused_retry_s`. An exception from it is a
    bug, which must cost the connection, never the process: `on_bug` says so, and the loop goes on."""
    backoff = RECONNECT_FIRST_S
    while running():
        started = asyncio.get_running_loop().time()
        try:
            await connect_once()
        except Exception as error:
            on_bug(error)
        if asyncio.get_running_loop().time() - started > 10 * RECONNECT_MAX_S:
            backoff = RECONNECT_FIRST_S  # it was up for a while: retry quickly
        await asyncio.sleep(refused_retry_s if refused() else backoff * (0.5 + random.random()))
        backoff = min(RECONNECT_MAX_S, backoff * 2)


def grpc_server_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Ping every client too: one that vanished (a frozen process, a dead host) would otherwise hold
        # its running place and sessions until TCP gives up, which can take hours. A peer that does not
        # answer within the timeout is dropped, which cancels its calls.
        *_keepalive_options(),
        # Keep pinging while a stream sends nothing (grpc stops after 2 pings without data by default):
        # a stalled stream is exactly when a vanished peer must be found.
        ("grpc.http2.max_pings_without_data", 0),
        # Ping, and accept the client's pings, also between calls instead of answering GOAWAY.
        ("grpc.keepalive_permit_without_calls", 1),
        # Clients ping every KEEPALIVE_TIME_MS (duo.target.link and duo generate do), through calls that send
        # nothing for minutes (a long prefill, a wait in the queue): allow pings half as far apart, and count
        # only faster ones as strikes. (grpc's name for GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS:
        # an unknown name is ignored silently, and grpc's default, one ping in 5 minutes, cut every client.)
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
        # grpc sets SO_REUSEPORT by default: a second process on the same port would then share it
        # silently (and take half the connections) instead of failing to start.
        ("grpc.so_reuseport", 0),
    ]


# Clients' calls at once on duo-target's gRPC port (beyond: RESOURCE_EXHAUSTED); generations are bounded
# further by --parallel and --queue-size. Their messages are capped like HTTP bodies.
MAX_CLIENT_RPCS = 256
MAX_CLIENT_MESSAGE_BYTES = 16 * 1024 * 1024


def client_server_options() -> list[tuple[str, int]]:
    """grpc_server_options for the clients' port: a client's messages are capped like an HTTP body, and a
    client that pings too often is cut off (grpc's ping-flood protection, which the draft link disables
    for its own peer)."""
    capped = {"grpc.max_receive_message_length": MAX_CLIENT_MESSAGE_BYTES,
              "grpc.max_send_message_length": MAX_CLIENT_MESSAGE_BYTES}
    return [(name, capped.get(name, value)) for name, value in grpc_server_options()
            if name != "grpc.http2.max_ping_strikes"]


def _keepalive_options() -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # What grpc core really waits for a ping's answer: it no longer enforces keepalive_timeout_ms
        # (grpc/grpc#39239), and this wait defaults to a minute.
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ]


def grpc_channel_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        *_keepalive_options(),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnection is ours (duo.target.link backs off itself); keep grpc's own backoff short.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


class HttpServer(uvicorn.Server):
    """uvicorn on the caller's event loop, without uvicorn's own signal handling: run_server stops it
    together with the gRPC server."""

    def capture_signals(self) -> AbstractContextManager[None]:
        return nullcontext()


def metrics_server(registry: CollectorRegistry, address: str) -> tuple[HttpServer, socket.socket]:
    """The server of /metrics (`registry`'s) and its listening socket on [HOST:]PORT (127.0.0.1 unless HOST
    says otherwise), ready for run_server's `http`: both processes' --metrics."""
    config = uvicorn.Config(make_asgi_app(registry), lifespan="off", log_config=None, access_log=False)
    return HttpServer(config), listen_socket(address)


async def run_server(server: grpc.aio.Server, address: str | None, banner: str, *,
                     credentials: grpc.ServerCredentials | None = None,
                     http: Sequence[tuple[HttpServer, socket.socket]] = (),
                     background: Callable[[], Awaitable[None]] | None = None,
                     stopping: Callable[[], None] | None = None,
                     draining: Callable[[], Awaitable[None]] | None = None) -> None:
    """Start `server` on `address` (TLS with `credentials`; None: on no port, for a draft that only dials out) and
    each (server, listening socket) pair of `http` on this same event loop, run `background` beside them, and stop
    them all cleanly on SIGINT/SIGTERM: call `stopping` (so that streams cut by the stop are not taken for
    failures), await `draining` (the requests in flight finish or end with an error), then stop every server
    together; if `background` fails, stop and raise its error."""
    if address is not None:
        try:
            port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError:  # grpc >= 1.60 raises where older versions returned 0
            port = 0
        if port == 0:
            raise SystemExit(cannot_listen(address, "the address is in use (another duo process?) or not this "
                                                    "machine's"))
    await server.start()
    logging.getLogger("duo").info(banner)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(stop.wait())
    http_tasks = [asyncio.create_task(http_server.serve(sockets=[sock])) for http_server, sock in http]
    background_task = asyncio.create_task(background()) if background else None
    try:
        await _until_stopped(stop, [task for task in (waiter, *http_tasks, background_task) if task])
    finally:
        if stopping:
            stopping()
        if draining:
            await draining()
        waiter.cancel()
        if background_task:
            background_task.cancel()
            await asyncio.gather(background_task, return_exceptions=True)
        for http_server, _ in http:
            http_server.should_exit = True
        await asyncio.gather(*http_tasks, server.stop(grace=2), return_exceptions=True)


async def _until_stopped(stop: asyncio.Event, tasks: list[asyncio.Task]) -> None:
    """Wait for `stop`, or for one of `tasks` to fail (raising its error); a task that simply ends is fine."""
    pending = set(tasks)
    while not stop.is_set():
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()


def listen_socket(address: str, default_host: str = "127.0.0.1") -> socket.socket:
    """A listening TCP socket on "HOST:PORT" (or "PORT" on `default_host`; IPv6 hosts in brackets)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or default_host
    if not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    try:
        return socket.create_server((host, int(port)), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as error:
        raise ValueError(f"cannot listen on {address}: {error.strerror or error}") from error


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (another process may take it before you do)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
