"""A request waits out a long prefill: keepalive pings keep a silent call alive, and only a ping flood is cut."""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress

import grpc
import httpx
import pytest
from grpc_health.v1 import health

from duo.net import listening, options
from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.api.serving.admit import Admission
from duo.api.serving.generate import Completions
from duo.api.grpc import client_server
from duo.api.http import create_app, http_server
from duo.api.serving.metrics import Metrics
from duo.cli.generate import stream
from helpers.scripted import ScriptedTarget

# The processes ping every 10 s; here every second (the most often a grpc client pings), so that a prefill
# of several periods takes seconds. Before the fix, grpc's ping-flood protection cut the call at the
# fourth ping of a silent call (three strikes).
KEEPALIVE_MS = 1000
PREFILL_S = 6.0  # 6 keepalive periods in which the call sends nothing
STEPS = [[3], [4]]  # " the end"


class SlowPrefill(ScriptedTarget):
    """A target whose prompt takes PREFILL_S before the first token (a 70B target's prefill takes minutes)."""

    async def generate(self, request, stats=None, progress=False):
        await asyncio.sleep(PREFILL_S)
        async for step in super().generate(request, stats):
            yield step


def slow_service() -> Completions:
    service = Completions(Admission(1, 0), Metrics(), ["scripted"])
    service.ready(SlowPrefill(STEPS), context_size=100)  # type: ignore[arg-type]
    return service


@pytest.fixture
def short_keepalive(monkeypatch):
    """Both sides' keepalive as the processes set it, every KEEPALIVE_MS instead of 10 s."""
    monkeypatch.setattr(options, "KEEPALIVE_TIME_MS", KEEPALIVE_MS)


async def serving_grpc(body) -> object:
    """Run `body(address)` against duo-target's client gRPC server over a slow prefill."""
    server = client_server(slow_service(), health.aio.HealthServicer(), None)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return await body(f"127.0.0.1:{port}")
    finally:
        await server.stop(0)


def test_duos_own_client_waits_out_a_prefill_of_many_keepalive_periods(short_keepalive):
    async def call(address: str) -> list[pb.GenerateResponse]:
        return await asyncio.to_thread(lambda: list(stream(address, pb.GenerateRequest(prompt="hi"))))

    began = time.monotonic()
    responses = asyncio.run(serving_grpc(call))
    assert time.monotonic() - began >= PREFILL_S
    assert "".join(r.text for r in responses) == " the end" and responses[-1].finish_reason == "length"


def test_another_client_with_a_keepalive_of_its_own_waits_out_the_prefill_too(short_keepalive):
    every_second = [("grpc.keepalive_time_ms", 1000), ("grpc.http2.max_pings_without_data", 0),
                    ("grpc.keepalive_permit_without_calls", 1)]

    async def call(address: str) -> list[pb.GenerateResponse]:
        async with grpc.aio.insecure_channel(address, options=every_second) as channel:
            return [r async for r in pb_grpc.TargetStub(channel).Generate(pb.GenerateRequest(prompt="hi"))]

    responses = asyncio.run(serving_grpc(call))
    assert "".join(r.text for r in responses) == " the end"


def test_a_peer_that_floods_pings_is_still_sent_away(short_keepalive):
    """grpc clients never ping faster than once a second; a raw HTTP/2 peer can, and is cut off."""
    preface, settings = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", frame(4, b"")
    ping = frame(6, b"duo-ping")

    async def flood(address: str) -> bytes:
        host, port = address.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(preface + settings)
        received = b""
        try:
            for _ in range(200):  # a ping every 10 ms: 50 times what the server allows
                writer.write(ping)
                await writer.drain()
                with suppress(asyncio.TimeoutError):
                    received += await asyncio.wait_for(reader.read(1 << 16), 0.01)
                if GOAWAY_TOO_MANY_PINGS in received:
                    break
        finally:
            writer.close()
        return received

    assert GOAWAY_TOO_MANY_PINGS in asyncio.run(serving_grpc(flood))


# A GOAWAY frame's error code ENHANCE_YOUR_CALM (0xb), followed by grpc's debug text for a ping flood.
GOAWAY_TOO_MANY_PINGS = (11).to_bytes(4, "big") + b"too_many_pings"


def frame(kind: int, payload: bytes) -> bytes:
    """An HTTP/2 frame on stream 0: 24-bit length, type, no flags, stream id 0, payload."""
    return len(payload).to_bytes(3, "big") + bytes([kind, 0]) + (0).to_bytes(4, "big") + payload


def test_a_streamed_http_request_waits_out_the_prefill(short_keepalive):
    async def run() -> list[str]:
        server = http_server(create_app(slow_service(), Metrics(), None), tls_cert=None, tls_key=None, debug=False)
        sock = listening.listen_socket("127.0.0.1:0")
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
            async with httpx.AsyncClient(timeout=30) as client:
                async with client.stream("POST", url, json={"prompt": "hi", "stream": True}) as response:
                    return [line async for line in response.aiter_lines() if line]
        finally:
            server.should_exit = True
            await serving

    lines = asyncio.run(run())
    assert lines[-1] == "data: [DONE]" and any('" the"' in line for line in lines), lines
