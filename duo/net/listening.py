"""Sockets a process listens on: an HTTP server on a socket of its own, a free port for tests and the bench."""

from __future__ import annotations

import socket
from contextlib import AbstractContextManager, nullcontext

import uvicorn


class HttpServer(uvicorn.Server):
    """uvicorn on the caller's event loop, without uvicorn's own signal handling: run_server stops it
    together with the gRPC server."""

    def capture_signals(self) -> AbstractContextManager[None]:
        return nullcontext()


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
