"""Process start-up shared by duo-draft and duo-target: their common flags, serving gRPC and metrics until a signal,
logging."""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import ipaddress
import logging
import signal
import socket
import sys
from typing import Any, Awaitable, Callable, Sequence

import grpc
import uvicorn
from prometheus_client import CollectorRegistry, make_asgi_app

from duo.llama.backends import DEVICES
from duo.llama.rpc import check_reachable, parse_endpoints, parse_tensor_split, rpc_arguments
from duo.net.listening import HttpServer, listen_socket

log = logging.getLogger("duo")


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
    parser.add_argument("--ctx-size", type=int, default=0,
                        help=f"context size per {per} (default 0: the model's training context, as llama-server's)")
    parser.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto",
                        help="llama.cpp's flash attention (llama-server's -fa). auto: off for a model on the CPU, "
                             "whose kernel reads the whole KV cache once per query row and runs slower there (at 2k "
                             "tokens of context, the Q4_0 draft on one core: 217 against 127 ms a token, a step of 8 "
                             "821 against 477 ms); llama.cpp's choice on a GPU (default: %(default)s)")
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help=f"serve {serves} over TLS with this PEM certificate (chain)")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="the PEM private key of --tls-cert")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="how much to log (any case): INFO logs one line per request on the target")
    rpc_arguments(parser)


def flash_attention(args: argparse.Namespace) -> bool | None:
    """--flash-attn: on or off as asked; auto: None, the model layer's choice (off on a CPU, llama.cpp's on a GPU)."""
    return None if args.flash_attn == "auto" else args.flash_attn == "on"


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
    """duo.llama.model.Model's keyword arguments from add_process_arguments' flags. ValueError for a bad flag,
    ModelError naming an --rpc server that does not answer (checked here, before anything starts)."""
    rpc = parse_endpoints(args.rpc) if args.rpc else []
    if args.tensor_split and not rpc:
        raise ValueError("--tensor-split splits the layers over --rpc servers: give --rpc too")
    split = parse_tensor_split(args.tensor_split, len(rpc))
    if rpc:
        check_reachable(rpc)
    return {"device": args.device, "n_gpu_layers": args.gpu_layers, "threads": args.threads, "rpc": rpc,
            "tensor_split": split}


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


def run_async(main: Awaitable[None]) -> int:
    """Run `main` on uvloop when available; then hand every object left to the interpreter's exit as it is."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
    # The interpreter's exit ends with a full garbage collection that walks every object still alive: millions with
    # a model's vocabulary and a linked draft's (152k tokens each), seconds on a loaded core (measured: duo-target
    # with a draft took 3-4 s to exit after its servers had stopped, llama-server's test suite kills at 5 s). The
    # servers are stopped and nothing left needs collecting before the process ends: freeze them out of its reach.
    gc.freeze()
    return 0


def freeze_startup_heap() -> None:
    """Collect what starting left as garbage, then move every object alive (modules, the app, the model's tables)
    into the collector's permanent generation. Python's full collection walks every tracked object alive, and a body
    of many small containers (a logit_bias of the whole vocabulary as pairs: 150k lists) sets off several while it is
    parsed: each walked the process's ~100k objects from its start again, under the GIL, pausing the event loop
    (measured on an Intel Xeon core: such a body's parse 147 ms with pauses up to 64 ms, 37 ms with the start-up heap
    frozen). Frozen objects still die when nothing refers to them; only a cycle through them is never collected."""
    gc.collect()
    gc.freeze()


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
