"""HTTP calls to a served duo-target: post, the OpenAI client, its model's name, /health, /metrics, greedy text, a
streamed answer's events."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable

import grpc
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from helpers.processes import Process


def client(process: Process, api_key: str = "unused") -> openai.OpenAI:
    # No retries: a test must see the first answer, 503s included.
    return openai.OpenAI(base_url=f"{process.http_url}/v1", api_key=api_key, max_retries=0, timeout=60)


def model_name(process: Process) -> str:
    return httpx.get(f"{process.http_url}/v1/models").json()["data"][0]["id"]


def greedy_text(process: Process, prompt: str, max_tokens: int) -> str:
    """The target's greedy completion as text, through gRPC (the reference for the HTTP answers)."""
    request = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens)
    with grpc.insecure_channel(process.address) as channel:
        return "".join(r.text for r in pb_grpc.TargetStub(channel).Generate(request, timeout=60))


def health(process: Process) -> dict:
    return httpx.get(f"{process.http_url}/health").json()


def wait_until_idle(process: Process, timeout: float = 10) -> dict:
    """/health once no request runs or waits and no draft session is open (fails after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        state = health(process)
        if state["requests_running"] == 0 and state["requests_waiting"] == 0 and state["draft_sessions"] == 0:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"still busy after {timeout}s: {state}")
        time.sleep(0.05)


def post(process: Process, path: str, body: dict | str, **kwargs) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{process.http_url}{path}", content=content, headers={"Content-Type": "application/json"},
                      timeout=60, **kwargs)


def sse_events(lines: Iterable[str], done: bool | None = None,
               parse_constant: Callable[[str], object] | None = None) -> list[dict]:
    """The JSON of each `data: ` line of a server-sent stream, every other line checked to be blank or an `event: `
    one, and a [DONE] to stand only last. `done` True: the stream ends with [DONE] (OpenAI's APIs); False: it has
    none (llama-server's own /completion, Anthropic's and the Responses API)."""
    data = []
    for line in lines:
        if line.startswith("data: "):
            data.append(line.removeprefix("data: "))
        else:
            assert not line or line.startswith("event: "), f"not a server-sent event's line: {line!r}"
    assert "[DONE]" not in data[:-1], data
    if done is not None:
        assert (data[-1:] == ["[DONE]"]) == done, data[-1:]
    return [json.loads(item, parse_constant=parse_constant) for item in data if item != "[DONE]"]


def streamed(process: Process, path: str, body: dict, done: bool | None = None, timeout: float = 60,
             parse_constant: Callable[[str], object] | None = None) -> list[dict]:
    """The events of `body` POSTed to `path` with "stream": true, after a 200 (sse_events)."""
    with httpx.stream("POST", f"{process.http_url}{path}", json={**body, "stream": True}, timeout=timeout) as answer:
        assert answer.status_code == 200, answer.read()
        return sse_events(answer.iter_lines(), done, parse_constant)


def stop_inside(text: str) -> str:
    """A stop string from the middle of `text` that spans a word boundary (so, a token boundary)."""
    middle = len(text) // 2
    start = text.index(" ", middle) - 2
    return text[start:start + 5]


def scrape(process: Process) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    text = httpx.get(f"{process.http_url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def generated_tokens(process: Process) -> float:
    return scrape(process)[("duo:generation_tokens_total", ())]


# The tiny model's context holds 2048 tokens: a whole answer to these requests is 2000-odd tokens,
# seconds of work; a client that leaves after a few must stop the generation long before that.
LEAVE_EARLY_TOKENS = 1000


def responses_events(process: Process, body: dict, timeout: float = 300) -> list[dict]:
    """A streamed /v1/responses answer's events as Codex reads them (`event:` then `data:` lines, the event's type in
    both), after a 200."""
    events, kind = [], None
    with httpx.stream("POST", f"{process.http_url}/v1/responses", json=body, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == kind
                events.append(event)
    return events
