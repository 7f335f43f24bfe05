"""A request that fails in the middle of generating (NaN logits, a bug) ends with an error of its API's own shape,
for that request alone: an SSE error event then [DONE], a JSON 500, or gRPC INTERNAL; the next request is served."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.api.serving.admit import Admission
from duo.api.serving.generate import Completions
from duo.api.grpc import client_server
from duo.api.serving.metrics import Metrics
from duo.target.request import Request
from helpers.asgi import app_client
from helpers.http import sse_events
from helpers.scripted import ScriptedTarget

STEPS = [[3], [4], [5]]  # " the end."
FAILURES = [ValueError("the logits hold NaN"), RuntimeError("a bug"), KeyError("missing")]


class FailsOnce(ScriptedTarget):
    """Fails with `error` after its first token, the first time only; then generates as scripted."""

    def __init__(self, error: Exception) -> None:
        super().__init__(STEPS)
        self.error: Exception | None = error

    async def generate(self, request: Request, stats=None, progress: bool = False):
        async for step in super().generate(request, stats):
            yield step
            if self.error is not None:
                error, self.error = self.error, None
                raise error


def service_failing_with(error: Exception) -> Completions:
    service = Completions(Admission(1, 0), Metrics(), ["scripted"])
    service.ready(FailsOnce(error), context_size=100)  # type: ignore[arg-type]
    return service


@pytest.mark.parametrize("error", FAILURES, ids=lambda e: type(e).__name__)
def test_a_streamed_completion_that_fails_ends_with_an_error_event_and_done(error):
    with app_client(service_failing_with(error)) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as response:
            failure = sse_events(response.iter_lines(), done=True)[-1]
        assert failure["error"]["type"] == "server_error", failure
        assert "generation failed" in failure["error"]["message"]
        again = client.post("/v1/completions", json={"prompt": "hi"})
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == " the end."


@pytest.mark.parametrize("error", FAILURES, ids=lambda e: type(e).__name__)
def test_a_whole_completion_that_fails_is_a_json_500_of_openais_shape(error):
    with app_client(service_failing_with(error), raise_server_exceptions=False) as client:
        failed = client.post("/v1/completions", json={"prompt": "hi"})
        assert failed.status_code == 500 and failed.headers["content-type"] == "application/json"
        assert failed.json()["error"]["type"] == "server_error"
        assert "generation failed" in failed.json()["error"]["message"]
        again = client.post("/v1/completions", json={"prompt": "hi"})
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == " the end."


@pytest.mark.parametrize("error", FAILURES, ids=lambda e: type(e).__name__)
def test_a_grpc_generation_that_fails_ends_with_internal_and_the_next_is_served(error):
    async def run() -> tuple[grpc.aio.AioRpcError, list[pb.GenerateResponse]]:
        server = client_server(service_failing_with(error), health.aio.HealthServicer(), None)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.TargetStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    async for _ in stub.Generate(pb.GenerateRequest(prompt="hi")):
                        pass
                return failed.value, [r async for r in stub.Generate(pb.GenerateRequest(prompt="hi"))]
        finally:
            await server.stop(0)

    failure, answer = asyncio.run(run())
    assert failure.code() == grpc.StatusCode.INTERNAL and "generation failed" in failure.details()
    assert "".join(r.text for r in answer) == " the end."


def test_a_request_that_fails_before_generating_is_a_json_500_too():
    """The scripted model has no chat template: rendering fails on an AttributeError, a bug, not a client's error."""
    service = Completions(Admission(1, 0), Metrics(), ["scripted"])
    service.ready(ScriptedTarget(STEPS), context_size=100)  # type: ignore[arg-type]
    with app_client(service, raise_server_exceptions=False) as client:
        failed = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error", failed.text
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
