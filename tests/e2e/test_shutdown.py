"""SIGTERM with requests in flight: new work is refused at once, every client in flight gets a finished answer or
an error of its API's shape (never a cut connection), and duo-target exits within its grace period."""

from __future__ import annotations

import json
import signal
import threading
import time

import grpc
import httpx

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from helpers.processes import health_status, start

GRACE_S = 1.0
BODY = {"prompt": "def fibonacci(n):", "max_tokens": 1800, "temperature": 0}  # far more than the grace allows


def stream_http(url: str) -> list[dict | str]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        return [json.loads(data) if data != "[DONE]" else data
                for line in response.iter_lines() if (data := line.removeprefix("data: ")) and line]


def whole_http(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)


def generate_grpc(address: str) -> list[pb.GenerateResponse] | grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        try:
            return list(pb_grpc.TargetStub(channel).Generate(pb.GenerateRequest(prompt=BODY["prompt"], max_tokens=1800),
                                                            timeout=60))
        except grpc.RpcError as error:
            return error


def running(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=5).json()["requests_running"]


def test_sigterm_lets_requests_finish_or_end_them_with_errors_of_their_apis_shape(tiny_target, process_logs):
    target = start("duo.cli.target", ["--model", str(tiny_target), "--parallel", "9", "--ctx-size", "2048",
                                      "--shutdown-grace", str(GRACE_S)], process_logs, http=True)
    url, results = target.http_url, {}

    def run(name: str, call, *args) -> None:
        results[name] = call(*args)

    calls = ([(f"stream {i}", stream_http, url) for i in range(4)] + [(f"whole {i}", whole_http, url) for i in range(4)]
             + [("grpc", generate_grpc, target.address)])
    threads = [threading.Thread(target=run, args=call) for call in calls]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while running(url) < len(calls):
        assert time.monotonic() < deadline, "the requests never all ran"
        time.sleep(0.02)

    target.popen.send_signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    time.sleep(0.2)
    refused = httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert health_status(target.address) == "NOT_SERVING"
    target.popen.wait(GRACE_S + 10)
    assert time.monotonic() - stopped_at < GRACE_S + 5  # the grace, then a moment for the errors to go out
    for thread in threads:
        thread.join(10)

    for name, result in results.items():
        if name.startswith("stream"):
            assert result[-1] == "[DONE]", (name, result[-3:])
            last = result[-2]
            assert last.get("error", {}).get("code") == "shutting_down" or last["choices"][0]["finish_reason"], last
        elif name.startswith("whole"):
            assert result.status_code == 200 or result.json()["error"]["code"] == "shutting_down", result.text
        else:
            assert isinstance(result, list) or (result.code() == grpc.StatusCode.UNAVAILABLE
                                                and "shutting down" in result.details()), result
    ended = [name for name, result in results.items()
             if (isinstance(result, list) and result and isinstance(result[-2], dict) and "error" in result[-2])
             or (isinstance(result, httpx.Response) and result.status_code == 503)
             or isinstance(result, grpc.RpcError)]
    assert ended, "no request outlived the grace period: the test proves nothing (make them longer)"
    assert "Traceback" not in target.log()
