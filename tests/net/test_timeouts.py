"""Timeouts that keep duo-target serving: a streaming client that stops reading is dropped after
--write-timeout, freeing its running place, its context and its draft session; a peer that vanished
is found by keepalive pings and dropped."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.net.options import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, grpc_channel_options, grpc_server_options
from helpers.processes import Process, generate, start, wait_for_draft

WRITE_TIMEOUT_S = 1.0
# The tiny models hold 2048 tokens: a generation until the context is full sends ~2000 events.
CONTEXT_SIZE = 2048


@pytest.fixture(scope="module")
def one_at_a_time(tiny_target, served_draft, process_logs):
    """duo-target running one generation at a time, with a short write timeout (no lookup: its pieces of several
    tokens would send fewer bytes than the stalled client's buffers hold)."""
    process = start("duo.cli.target", ["--model", str(tiny_target), "--peer", served_draft.address,
                                           "--draft-max", "4", "--parallel", "1", "--queue-size", "4", "--no-lookup",
                                           "--ctx-size", str(CONTEXT_SIZE), "--write-timeout", str(WRITE_TIMEOUT_S)],
                    process_logs, http=True)
    wait_for_draft(process.address)
    yield process
    process.stop()


def health(process: Process) -> dict:
    return httpx.get(f"{process.http_url}/health").json()


def write_timeouts(process: Process) -> float:
    for line in httpx.get(f"{process.http_url}/metrics").text.splitlines():
        if line.startswith("duo:client_write_timeouts_total "):
            return float(line.split()[1])
    raise AssertionError("no duo:client_write_timeouts_total in /metrics")


def wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout} s")
        time.sleep(0.05)


def idle(process: Process) -> bool:
    state = health(process)
    return state["requests_running"] == 0 and state["requests_waiting"] == 0 and state["draft_sessions"] == 0


def stalled_http_client(process: Process, body: dict, requests: int) -> socket.socket:
    """A connection that sends `requests` pipelined requests and never reads an answer.

    Loopback absorbs megabytes: the receive buffer and the segment size are made small before
    connecting, so that the server's socket buffers fill after a few hundred kB.
    """
    host, port = process.http_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect((host, int(port)))
    content = json.dumps(body)
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(content)}\r\n\r\n{content}")
    sock.sendall((request * requests).encode())
    return sock


def test_a_streaming_http_client_that_stops_reading_is_dropped_and_the_next_one_served(one_at_a_time):
    process = one_at_a_time
    before = write_timeouts(process)
    expected = generate(process.address, "The quick brown fox", max_tokens=8)[0]
    stalled = stalled_http_client(process, {"messages": [{"role": "user", "content": "Tell me a long story"}],
                                            "stream": True, "temperature": 0,
                                            "stream_options": {"include_usage": True}}, requests=3)
    try:
        wait_for(lambda: health(process)["requests_running"] == 1, "the stalled request runs")
        # It waits behind the stalled client: only the write timeout can give it a turn.
        answer = httpx.post(f"{process.http_url}/v1/completions", timeout=60,
                            json={"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0})
        assert answer.status_code == 200
        assert answer.json()["usage"]["completion_tokens"] == len(expected)
        assert write_timeouts(process) == before + 1
        assert "dropped client" in process.log() and "--write-timeout" in process.log()
        wait_for(lambda: idle(process), "no request, context or draft session left")
    finally:
        stalled.close()


def test_a_grpc_client_that_stops_reading_is_dropped_with_deadline_exceeded(one_at_a_time):
    process = one_at_a_time
    before = write_timeouts(process)
    # A client whose flow control window stays small (no bandwidth probes, little read-ahead), so that
    # the server's writes block after about a kilobyte instead of megabytes.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    with grpc.insecure_channel(process.address, options=options) as channel:
        stalled = pb_grpc.TargetStub(channel).Generate(pb.GenerateRequest(prompt="Once upon a time"), timeout=120)
        wait_for(lambda: health(process)["requests_running"] == 1, "the stalled request runs")
        tokens, last = generate(process.address, "The quick brown fox", max_tokens=8, timeout=60)
        assert len(tokens) == 8 and last.finish_reason == "length"
        assert write_timeouts(process) == before + 1
        with pytest.raises(grpc.RpcError) as dropped:
            for _ in stalled:  # what the server had sent before giving up, then its status
                pass
        assert dropped.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--write-timeout" in dropped.value.details()
    wait_for(lambda: idle(process), "no request, context or draft session left")


# --- keepalive -------------------------------------------------------------------------------------

# A client that opens a stream, says so, and then reads on (until it is frozen).
STREAMING_CLIENT = """
import sys, grpc
channel = grpc.insecure_channel(sys.argv[1])
for message in channel.unary_stream("/test.Slow/Stream")(b""):
    print("streaming", flush=True)
"""


@pytest.mark.parametrize("options", [grpc_server_options(), grpc_channel_options()], ids=["servers", "the link"])
def test_grpc_servers_and_the_link_ping_their_peers_and_wait_a_bounded_time_for_the_answer(options):
    options = dict(options)
    assert options["grpc.keepalive_time_ms"] == KEEPALIVE_TIME_MS
    assert options["grpc.keepalive_timeout_ms"] == options["grpc.http2.ping_timeout_ms"] == KEEPALIVE_TIMEOUT_MS
    assert options["grpc.http2.max_pings_without_data"] == 0


def test_a_grpc_server_drops_a_peer_that_froze_mid_stream():
    """duo-target's and duo-draft's server options, with the pings 20 times faster: a client process
    frozen (SIGSTOP) mid-stream never answers a ping, and its call is cancelled within time + timeout."""
    time_ms, timeout_ms = KEEPALIVE_TIME_MS // 20, KEEPALIVE_TIMEOUT_MS // 20
    options = {**dict(grpc_server_options()), "grpc.keepalive_time_ms": time_ms,
               "grpc.keepalive_timeout_ms": timeout_ms, "grpc.http2.ping_timeout_ms": timeout_ms}
    window_s = (time_ms + timeout_ms) / 1000

    async def scenario() -> float:
        ended = asyncio.Event()

        async def stream(request: bytes, context: grpc.aio.ServicerContext):
            try:
                while True:
                    yield b"token"
                    await asyncio.sleep(0.05)
            finally:
                ended.set()

        server = grpc.aio.server(options=list(options.items()))
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "test.Slow", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = subprocess.Popen([sys.executable, "-c", STREAMING_CLIENT, f"127.0.0.1:{port}"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert await asyncio.to_thread(client.stdout.readline) == "streaming\n"
            client.send_signal(signal.SIGSTOP)
            frozen = time.monotonic()
            await asyncio.wait_for(ended.wait(), timeout=4 * window_s + 5)
            return time.monotonic() - frozen
        finally:
            client.kill()
            client.wait()
            await server.stop(0)

    dropped_after = asyncio.run(scenario())
    assert dropped_after < 4 * window_s + 2  # a loaded machine's late pings aside; never dropped would be 4w + 5
