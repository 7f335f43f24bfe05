"""Completions, the transport-free client layer, on a scripted target (no model): text, stops, admission, loading."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import pytest
from fastapi.testclient import TestClient

from duo.api.http import create_app
from duo.api.http.gate import Gate
from duo.api.openai import bodies
from duo.api.serving.admit import Admission, QueueFull
from duo.api.serving.generate import MAX_BODY_BYTES, Completions
from duo.api.serving.metrics import Metrics
from duo.api.serving.request import BadRequest, CompletionRequest, NotReady
from duo.llama.templates import ChatTemplate
from helpers.asgi import app_client, unloaded_app
from helpers.scripted import ScriptedModel, ScriptedTarget


def completions(steps: list[list[int]], parallel: int = 1, queue_size: int = 0) -> tuple[Completions, ScriptedTarget]:
    service = Completions(Admission(parallel, queue_size), Metrics(), ["scripted"])
    target = ScriptedTarget(steps)
    service.ready(target, context_size=100)  # type: ignore[arg-type]
    return service, target


def collect(service: Completions, request: CompletionRequest) -> list:
    async def run():
        [completion] = await service.start_choices([request])
        async with aclosing(completion):
            return [piece async for piece in completion]

    return asyncio.run(run())


def test_a_character_split_across_tokens_arrives_whole():
    service, _ = completions([[3], [1], [2], [4]])
    pieces = collect(service, CompletionRequest(prompt="hi"))
    assert [p.text for p in pieces] == [" the", "", "日", " end"]
    assert [p.token_ids for p in pieces] == [[3], [1], [2], [4]]


def test_a_stop_string_ends_the_text_and_closes_the_targets_generation_at_once():
    service, target = completions([[3], [4], [5], [3], [3], [3]])

    async def run():
        [completion] = await service.start_choices([CompletionRequest(prompt="hi", stop=["end."])])
        async with aclosing(completion):
            pieces = [piece async for piece in completion]
            assert target.closed == 1, "the target's generation should be closed as soon as the stop is seen"
        return pieces

    pieces = asyncio.run(run())
    assert "".join(p.text for p in pieces) == " the "
    assert pieces[-1].finish_reason == "stop"
    assert target.generated == 3
    assert service.admission.running == 0


def test_text_held_back_for_a_stop_string_is_released_at_the_end():
    service, _ = completions([[3], [4]])
    pieces = collect(service, CompletionRequest(prompt="hi", stop=[" end!"]))
    assert [p.text for p in pieces] == [" the", " end"]
    assert pieces[-1].finish_reason == "length"


def test_closing_a_completion_early_frees_its_place_and_its_session():
    service, target = completions([[3]] * 10)

    async def run():
        [completion] = await service.start_choices([CompletionRequest(prompt="hi")])
        async for _ in completion:
            break
        await completion.aclose()

    asyncio.run(run())
    assert target.closed == 1 and service.admission.running == 0


def test_requests_beyond_running_and_waiting_places_are_refused():
    service, _ = completions([[3]], parallel=1, queue_size=0)

    async def run():
        [first] = await service.start_choices([CompletionRequest(prompt="hi")])
        with pytest.raises(QueueFull):
            await service.start_choices([CompletionRequest(prompt="hi")])
        await first.aclose()
        await (await service.start_choices([CompletionRequest(prompt="hi")]))[0].aclose()

    asyncio.run(run())


@pytest.mark.parametrize("request_, words", [
    (CompletionRequest(prompt="a " * 100), r"exceeds the available context size \(100 tokens\)"),
    (CompletionRequest(prompt="x" * 401), "far longer than the context"),  # 100 tokens of at most 4 bytes
    (CompletionRequest(prompt=""), "empty"),
    (CompletionRequest(prompt_tokens=[99]), "token ids"),
    (CompletionRequest(prompt="hi", max_tokens=-1), "max_tokens"),
    (CompletionRequest(prompt="hi", seed=2 ** 64), "seed"),
    (CompletionRequest(prompt="hi", stop=["x"] * 17), "at most 16"),
])
def test_bad_requests_say_what_to_fix(request_, words):
    service, _ = completions([[3]])
    with pytest.raises(BadRequest, match=words):
        service.prepare(request_)


def test_while_loading_requests_are_not_ready_and_http_answers_503():
    service = Completions(Admission(1, 1), Metrics(), ["loading-model"])
    with pytest.raises(NotReady):
        service.prepare(CompletionRequest(prompt="hi"))
    http = app_client(service)
    response = http.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 503 and response.json()["error"]["code"] == "model_loading"
    assert response.headers["retry-after"] == "1"
    assert http.get("/health").status_code == 503 and http.get("/health").json()["status"] == "loading"
    assert http.get("/v1/models").json()["data"][0]["id"] == "loading-model"


def test_an_oversized_body_is_refused_before_it_is_read():
    http = TestClient(unloaded_app(names=["m"]))
    response = http.post("/v1/completions", content=b"x" * (17 * 1024 * 1024),
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "larger than" in response.json()["error"]["message"]


def test_a_chat_templates_own_refusal_is_a_400_with_its_message(target_model, monkeypatch):
    """Gemma's, Mistral's and Llama 2's templates call raise_exception on roles out of order."""
    refusing = ChatTemplate(
        "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Conversation roles must "
        "alternate user/assistant/user/assistant/...') }}{% endif %}{{ messages[0]['content'] }}",
        eos_token="</s>", bos_token="<s>")
    monkeypatch.setattr(target_model, "_chat_renderer", refusing)
    service = Completions(Admission(1, 1), Metrics(), ["m"])
    service.ready(ScriptedTarget([[3]], model=target_model), context_size=100)  # type: ignore[arg-type]
    http = app_client(service)
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "hi"},
                                                                    {"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    assert "roles must alternate" in response.json()["error"]["message"]
    assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 200


def test_admission_comes_before_tokenizing_for_generations_and_for_tokenize_each_in_its_own_line(monkeypatch):
    service, _ = completions([[3]], parallel=1, queue_size=0)
    service.tokenizing_admission = Admission(1, 0)
    prepared = []
    monkeypatch.setattr(service, "prepare", lambda request: prepared.append(request) or None)
    tokenized = []
    monkeypatch.setattr(service, "tokenize", lambda prompt, messages: tokenized.append(prompt) or [3])

    async def run() -> None:
        slot = await service.admission.acquire()  # the one running place is taken
        with pytest.raises(QueueFull):
            await service.start_choices([CompletionRequest(prompt="a prompt " * 10)])
        assert await service.tokenizing(service.tokenize, "hi", ()) == [3]  # not behind the generation
        tokenizing = await service.tokenizing_admission.acquire()  # the one tokenize place is taken
        with pytest.raises(QueueFull):
            await service.tokenizing(service.tokenize, "a long prompt", ())
        assert prepared == [] and tokenized == ["hi"]  # no work was done for what was not admitted
        slot.release()
        tokenizing.release()
        assert await service.tokenizing(service.tokenize, "hi", ()) == [3]
        assert service.tokenizing_admission.running == 0 and service.admission.running == 0  # places given back

    asyncio.run(run())


def test_the_api_key_is_checked_before_any_body_is_read_and_a_trickling_body_times_out():
    service = Completions(Admission(1, 1), Metrics(), ["m"])
    app = Gate(create_app(service, Metrics(), api_key="k").app.app, lambda: MAX_BODY_BYTES, "k", read_timeout=0.2)
    sent: list[dict] = []

    async def send(message) -> None:
        sent.append(message)

    async def never() -> dict:  # a client that sends headers, then nothing
        await asyncio.sleep(3600)

    def call(headers: list[tuple[bytes, bytes]]) -> int:
        sent.clear()
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
                 "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("t", 80),
                 "client": ("c", 1), "root_path": ""}
        asyncio.run(asyncio.wait_for(app(scope, never, send), 5))
        return sent[0]["status"]

    huge = (b"content-length", str(10 ** 9).encode())
    assert call([huge]) == 401  # refused on its headers: neither read nor judged by its size
    assert call([huge, (b"authorization", b"Bearer k")]) == 413
    ok = [(b"content-length", b"20"), (b"authorization", b"Bearer k"), (b"content-type", b"application/json")]
    assert call(ok) == 408


class BosModel(ScriptedModel):
    """Tokenizes as llama.cpp does for a model that adds BOS: even no text is one token."""

    def tokenize(self, text: str) -> list[int]:
        return [6] + super().tokenize(text)


def test_a_prompt_of_no_token_ids_is_refused_not_generated_from_bos():
    service = Completions(Admission(1, 0), Metrics(), ["scripted"])
    target = ScriptedTarget([[3]], model=BosModel())
    service.ready(target, context_size=100)  # type: ignore[arg-type]
    with app_client(service) as client:
        response = client.post("/v1/completions", json={"prompt": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert target.generated == 0


def test_a_tokenize_call_does_not_wait_behind_running_generations():
    service, _ = completions([[3]] * 3, parallel=1, queue_size=0)

    async def run() -> list[int]:
        [completion] = await service.start_choices([CompletionRequest(prompt="hi")])  # the one generation place, held
        async with aclosing(completion):
            return await asyncio.wait_for(service.tokenizing(service.tokenize, "one two three", ()), timeout=5)

    assert asyncio.run(run()) == [3, 3, 3]


@pytest.mark.parametrize("request_", [CompletionRequest(prompt_tokens=[3] * 100), CompletionRequest(prompt="word " * 5000),
                                      CompletionRequest(messages=[{"role": "user", "content": ""}] * 100)],
                         ids=["token ids", "text", "messages"])
def test_a_prompt_that_cannot_fit_the_context_is_refused_before_it_waits_for_a_place(request_):
    service, _ = completions([[3]], parallel=1, queue_size=4)

    async def run() -> None:
        slot = await service.admission.acquire()  # every place taken: a request would wait in line
        with pytest.raises(BadRequest, match="context"):
            await asyncio.wait_for(service.start_choices([request_]), timeout=2)
        assert service.admission.waiting == 0
        slot.release()

    asyncio.run(run())


def test_a_client_that_leaves_while_its_prompt_is_tokenized_keeps_its_place_until_the_tokenizing_stops(monkeypatch):
    service, _ = completions([[3]], parallel=1, queue_size=0)
    prepare = service.prepare
    monkeypatch.setattr(service, "prepare", lambda request: time.sleep(0.5) or prepare(request))

    async def run() -> None:
        starting = asyncio.ensure_future(service.start_choices([CompletionRequest(prompt="hi")]))
        await asyncio.sleep(0.1)
        starting.cancel()  # the client left (unless_disconnected cancels the start)
        with pytest.raises(asyncio.CancelledError):
            await starting
        assert service.admission.running == 1  # the thread still works for it: its place is not free
        await asyncio.sleep(0.6)
        assert service.admission.running == 0

    asyncio.run(run())


def test_once_the_model_is_loaded_a_body_larger_than_its_context_can_use_is_refused_unread():
    service, _ = completions([[3]])  # a context of 100 tokens of at most 4 bytes each
    limit = service.max_body_bytes()
    assert limit < MAX_BODY_BYTES
    with app_client(service) as http:
        response = http.post("/v1/completions", content=b" " * (limit + 1), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "context" in response.json()["error"]["message"]


@pytest.mark.parametrize("body", [{"prompt": [3] * 5000}, {"messages": [{"role": "user", "content": ""}] * 5000}],
                         ids=["token ids", "messages"])
def test_a_list_longer_than_the_context_is_refused_before_its_items_are_validated(body, monkeypatch):
    validated = []
    for kind in (bodies.CompletionBody, bodies.ChatBody):
        monkeypatch.setattr(kind, "model_validate", classmethod(lambda cls, data: validated.append(data)))
    service, _ = completions([[3]])
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    with app_client(service) as http:
        response = http.post(path, json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert validated == []


def test_the_openapi_document_still_describes_the_request_bodies():
    service, _ = completions([[3]])
    with app_client(service) as http:
        schema = http.get("/openapi.json").json()
    for path, name in (("/v1/completions", "CompletionBody"), ("/v1/chat/completions", "ChatBody")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
    assert "prompt" in schema["components"]["schemas"]["CompletionBody"]["properties"]
    assert "StreamOptions" in schema["components"]["schemas"]  # a nested model, referenced where it is used
