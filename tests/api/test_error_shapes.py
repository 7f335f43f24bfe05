"""Every error answer in its protocol's shape: what the chat route answers in OpenAI's, the Messages API's paths answer
in Anthropic's, with the same status, the same headers and the same message, whoever refused the request (CORS, the
gate's key and size checks, reading the body, the routes, admission, a generation that failed, a bug)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest

from duo.api.http import create_app
from duo.api.serving.admit import Admission, QueueFull
from duo.api.serving.choices import Choice, Choices
from duo.api.serving.generate import Completions
from duo.constraint import GrammarError
from duo.api.serving.metrics import Metrics
from duo.api.serving.request import ShuttingDown
from helpers.asgi import asgi_call
from helpers.scripted import ScriptedModel, ScriptedTarget

PAGE = "https://page.example"
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
ASK = [{"role": "user", "content": "hi"}]
GOOD = {CHAT: {"messages": ASK, "max_tokens": 2}, MESSAGES: {"model": "m", "messages": ASK, "max_tokens": 2},
        COUNT: {"model": "m", "messages": ASK}}
# Anthropic's error type of each status duo answers.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "not_found_error", 408: "invalid_request_error",
                   413: "request_too_large", 500: "api_error", 503: "overloaded_error"}


@dataclass
class Case:
    """One way to be refused: the app, what is sent to each path, and what goes wrong on the way."""
    status: int
    loaded: bool = True
    api_key: str | None = None
    origins: list[str] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: Callable[[str], bytes] = lambda path: json.dumps(GOOD[path]).encode()
    method: str = "POST"
    suffix: str = ""  # after the path: a route that is not there
    fails: Callable[[pytest.MonkeyPatch], None] | None = None
    paths: tuple[str, ...] = (MESSAGES, COUNT)  # the Messages API's paths it is checked on, beside the chat's


def raising(error: Exception) -> Callable[..., None]:
    def fail(*args: object, **kwargs: object) -> None:
        raise error
    return fail


def failing_start(error: Exception) -> Callable[[pytest.MonkeyPatch], None]:
    async def start(*args: object) -> None:
        raise error
    return lambda monkeypatch: monkeypatch.setattr(Choices, "start", start)


class FailingCompletion:
    """A completion that fails before its first piece."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __aiter__(self) -> FailingCompletion:
        return self

    async def __anext__(self) -> None:
        raise self.error

    async def aclose(self) -> None:
        pass


def failing_generation(error: Exception) -> Callable[[pytest.MonkeyPatch], None]:
    async def start(*args: object) -> Choices:
        return Choices([Choice(FailingCompletion(error))])  # type: ignore[arg-type]
    return lambda monkeypatch: monkeypatch.setattr(Choices, "start", start)


CASES = {
    "not JSON": Case(400, body=lambda path: b'{"messages": ['),
    "not an object": Case(400, body=lambda path: b"[1, 2]"),
    "a field of the wrong type": Case(400, body=lambda path: json.dumps({**GOOD[path], "messages": 5}).encode()),
    "no such route": Case(404, suffix="/nowhere"),
    "a method the route has not": Case(405, method="GET"),
    "the key missing": Case(401, api_key="sekrit"),
    "the key wrong": Case(401, api_key="sekrit", headers={"Authorization": "Bearer nope"}),
    "an origin off the list": Case(403, origins=["http://allowed.example"], headers={"Origin": PAGE}),
    "a body larger than it says it may be": Case(413, body=lambda path: b" " * 2_000_000),
    "a body larger than it may be, in chunks": Case(413, body=lambda path: b" " * 2_000_000,
                                                    headers={"Transfer-Encoding": "chunked"}),
    "the model loading": Case(503, loaded=False),
    "the queue full": Case(503, fails=failing_start(QueueFull("every place is taken")), paths=(MESSAGES,)),
    "shutting down": Case(503, fails=failing_start(ShuttingDown("duo-target is stopping")), paths=(MESSAGES,)),
    "a bug while starting": Case(500, fails=failing_start(RuntimeError("a bug")), paths=(MESSAGES,)),
    "a generation that failed": Case(500, fails=failing_generation(RuntimeError("a bug")), paths=(MESSAGES,)),
    "a generation the request ended": Case(400, fails=failing_generation(GrammarError("no token fits")),
                                           paths=(MESSAGES,)),
    "shut down while generating": Case(503, fails=failing_generation(ShuttingDown("stopping")), paths=(MESSAGES,)),
}


def an_app(case: Case):
    completions = Completions(Admission(1, 1), Metrics(), ["scripted"])
    if case.loaded:
        completions.ready(ScriptedTarget([[3], [4]]), context_size=100)  # type: ignore[arg-type]
    return create_app(completions, Metrics(), case.api_key, cors_origins=case.origins)


def answered(case: Case, path: str) -> httpx.Response:
    """What the app answers `case`'s request to `path` (a bug's 500 answered, not raised)."""
    content: bytes | AsyncIterator[bytes] | None = case.body(path) if case.method == "POST" else None
    headers = {"Content-Type": "application/json", **case.headers}
    if "Transfer-Encoding" in headers:  # sent in pieces, without a length: the gate counts as they come
        headers.pop("Transfer-Encoding")
        content = in_pieces(content or b"")
    return asgi_call(an_app(case), case.method, path + case.suffix, headers, content, raise_app_exceptions=False)


async def in_pieces(content: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(content), 65536):
        yield content[start:start + 65536]


def headers_but_length(answer: httpx.Response) -> list[tuple[bytes, bytes]]:
    return sorted((name.lower(), value) for name, value in answer.headers.raw if name.lower() != b"content-length")


@pytest.mark.parametrize("name", CASES)
def test_the_messages_paths_answer_every_error_the_chat_route_does_in_anthropics_shape(name, monkeypatch):
    case = CASES[name]
    monkeypatch.setattr(ScriptedModel, "chat_template", lambda self: "", raising=False)  # no tool calls
    if case.fails:
        case.fails(monkeypatch)
    chat = answered(case, CHAT)
    error = chat.json()["error"]
    assert chat.status_code == case.status and set(error) >= {"message", "type", "param", "code"}, chat.text
    assert chat.headers["content-type"] == "application/json"
    for path in case.paths:
        answer = answered(case, path)
        message = error["message"].replace(CHAT, path)  # a route that is not there is named in its message
        expected = {"type": "error", "error": {"type": ANTHROPIC_TYPES[case.status], "message": message}}
        assert answer.status_code == case.status, (path, answer.text)
        assert answer.content == json.dumps(expected, ensure_ascii=False).encode(), path
        assert headers_but_length(answer) == headers_but_length(chat), path
        assert answer.headers["content-length"] == str(len(answer.content))
