"""duo/bench/live/proxy.py: a client that gives up on an answer not yet begun takes its upstream request with it."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from duo.bench.live.proxy import CLIENT_LEFT, LoggingProxy


class SilentUpstream:
    """An HTTP server that reads a request and never answers; it notes when the caller closes the connection."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.requests = 0
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        connection, _ = self.listener.accept()
        with connection:
            connection.recv(1 << 16)
            self.requests += 1
            while connection.recv(1 << 16):  # b"" once the proxy closes its side
                pass
        self.closed.set()


def test_a_request_whose_client_leaves_before_the_answer_is_cancelled_upstream_and_recorded_as_client_left():
    upstream = SilentUpstream()
    with LoggingProxy(upstream.url) as proxy:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{proxy.url}/v1/messages", json={"stream": False}, timeout=httpx.Timeout(0.5, connect=5))
        assert upstream.closed.wait(10), "the proxy kept the upstream request open after its client left"
        deadline = time.monotonic() + 5
        while not proxy.exchanges[0].done and time.monotonic() < deadline:
            time.sleep(0.02)
    assert upstream.requests == 1
    exchange = proxy.exchanges[0]
    assert (exchange.status, exchange.done) == (CLIENT_LEFT, True)
    # The client's 0.5 s read timeout starts once it has sent the body, after the proxy's clock started on the headers:
    # the exchange lasts about that long (a CI run measured 0.498 s), not an instant.
    assert exchange.seconds >= 0.4
