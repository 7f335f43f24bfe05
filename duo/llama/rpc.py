"""A target bigger than one machine: ggml's RPC servers hold some of its layers (llama.cpp's --rpc, `duo rpc-server`).

The RPC protocol is unauthenticated and unencrypted: anyone who reaches a server's port can make it
allocate memory and run computations. Serve it on a trusted network or through a tunnel only.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence

from duo.llama.backends import DEVICES, NO_RPC, rpc_supported, serve_rpc
from duo.llama.model import ModelError

DEFAULT_LISTEN = "127.0.0.1:50052"  # llama.cpp's rpc-server default port; loopback unless asked otherwise
CONNECT_TIMEOUT_S = 5.0


def parse_endpoints(value: str, flag: str = "--rpc") -> list[str]:
    """HOST:PORT[,HOST:PORT...] as a list; ValueError naming `flag` and the entry that is not one."""
    endpoints = [part.strip() for part in value.split(",") if part.strip()]
    if not endpoints:
        raise ValueError(f"{flag} needs at least one HOST:PORT")
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{flag}: {endpoint!r} is not HOST:PORT")
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"{flag} names a server twice")
    return endpoints


def parse_tensor_split(value: str | None, n_endpoints: int) -> list[float]:
    """--tensor-split's proportions (one per RPC server), or [] for llama.cpp's default (free memory)."""
    if not value:
        return []
    try:
        split = [float(part) for part in value.split(",")]
    except ValueError:
        raise ValueError(f"--tensor-split takes comma-separated numbers, got {value!r}") from None
    if len(split) != n_endpoints or any(not x >= 0 for x in split) or not sum(split) > 0:
        raise ValueError(f"--tensor-split needs {n_endpoints} non-negative proportions (one per --rpc server) "
                         f"with a positive sum, got {value!r}")
    return split


def check_reachable(endpoints: Sequence[str], timeout: float = CONNECT_TIMEOUT_S) -> None:
    """ModelError naming the first server that does not accept a connection within `timeout`: ggml
    itself would abort the process, or wait for the system's connect timeout (minutes)."""
    if not rpc_supported():
        raise ModelError(NO_RPC)
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        except OSError as error:
            raise ModelError(f"the RPC server at {endpoint} is unreachable ({error or 'timed out'}): start it "
                             f"there with `duo rpc-server --listen {endpoint}` (or llama.cpp's rpc-server)") from None


def rpc_arguments(parser: argparse.ArgumentParser) -> None:
    """--rpc and --tensor-split, for both processes."""
    parser.add_argument("--rpc", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                        help="split the model's layers over these ggml RPC servers (`duo rpc-server`, or "
                             "llama.cpp's rpc-server of the same version), as llama.cpp's --rpc does: all "
                             "layers by default, the last --gpu-layers N otherwise (the rest stay here)")
    parser.add_argument("--tensor-split", default=None, metavar="P1,P2,...",
                        help="with --rpc: the share of the offloaded layers each server takes (default: by "
                             "their free memory)")


def add_rpc_server_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rpc-server", help="serve this machine's CPU or GPU to a duo-target split over machines (--rpc)",
        description="ggml's RPC server, interoperable with llama.cpp's rpc-server of the same version: a "
                    "duo-target or duo-draft started with --rpc HOST:PORT keeps some of its layers here. The "
                    "protocol is unauthenticated: bind to a trusted network or reach it through a tunnel.")
    parser.add_argument("--listen", default=DEFAULT_LISTEN,
                        help="HOST:PORT to serve on (default: %(default)s; 0.0.0.0 only on a trusted network)")
    parser.add_argument("--device", default="cpu", choices=[d for d in DEVICES if d != "auto"],
                        help="the device whose memory and compute to serve (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--cache", default=None, metavar="DIR",
                        help="keep tensors clients sent in DIR, so that a client loading the same model again "
                             "sends hashes instead of weights")
    parser.set_defaults(func=run_rpc_server)


def run_rpc_server(args: argparse.Namespace) -> int:
    try:
        if len(parse_endpoints(args.listen, "--listen")) != 1:
            raise ValueError(f"--listen takes one HOST:PORT, got {args.listen!r}")
        if args.threads is not None and args.threads < 1:
            raise ValueError("--threads must be at least 1")
    except ValueError as error:
        print(f"duo rpc-server: {error}", file=sys.stderr)
        return 2
    if args.cache:
        os.makedirs(args.cache, exist_ok=True)
    threads = args.threads or max(1, os.cpu_count() or 1)
    stopped = threading.Event()
    failure: list[str] = []

    def serve() -> None:
        try:
            serve_rpc(args.listen, device=args.device, threads=threads, cache_dir=args.cache)
            failure.append(f"the RPC server could not listen on {args.listen} (is the port in use?)")
        except ModelError as error:
            failure.append(str(error))
        stopped.set()

    # ggml's server loop never returns while it serves and holds no Python lock, so it runs on a thread
    # of its own while the main thread waits for a signal to stop (or for the loop to fail).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    threading.Thread(target=serve, name="rpc-server", daemon=True).start()
    print(f"duo rpc-server: serving {args.device} on {args.listen} (unauthenticated: trusted networks only)",
          file=sys.stderr, flush=True)
    while not stopped.wait(0.5):
        pass
    if failure:
        print(f"duo rpc-server: {failure[0]}", file=sys.stderr, flush=True)
        return 1
    return 0
