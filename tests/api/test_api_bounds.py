"""Request bounds of the HTTP API (issue 49, items 3, 4 and 7): lists at every depth the protocols have, and their
items together, are bounded by the context before validation; names and ids by what any template renders; the
Responses store counts all it holds; ignored field names are kept clipped. Served by a scripted target (duo.api's
test double: a context of 100 tokens) unless a real model's tokenizer is the point."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from duo.api.serving import bodies
from duo.api.openai.bodies import ChatBody
from duo.api.serving.limits import MAX_ID_LENGTH, MAX_NAME_LENGTH, MAX_OBJECT_KEYS, MAX_TOOLS, BodyLimits
from duo.api.serving.read import check_shape, parse_body
from duo.api.serving.prepare import Preparer
from duo.api.serving.request import BadRequest
from duo.api.responses.body import ResponsesBody
from duo.api.http.responses import ResponsesApi
from duo.api.responses.store import ResponseStore, characters
from duo.api.responses.tools import ResponsesTools
from helpers.asgi import app_client
from helpers.scripted import scripted
from helpers.http import post

CONTEXT = 100  # the scripted target's
TOO_MANY = CONTEXT + 50
USER = {"role": "user", "content": "hi"}


def posted(path: str, body: dict) -> tuple[int, dict]:
    with app_client(scripted()) as http:
        response = http.post(path, json=body)
    return response.status_code, response.json()


def parts(n: int, kind: str = "text") -> list[dict]:
    return [{"type": kind, "text": "a"}] * n


def call(call_id: str = "call_1", name: str = "f") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


# --- item 3: lists at every depth, and all of them together, fit the context ----------------------------------

def test_a_responses_input_of_more_items_than_the_context_holds_is_a_400_saying_so():
    status, answer = posted("/v1/responses", {"input": [USER] * TOO_MANY})
    error = answer["error"]
    assert status == 400 and error["param"] == "input", answer
    assert error["code"] == "context_length_exceeded" and error["type"] == "exceed_context_size_error"
    assert (error["n_prompt_tokens"], error["n_ctx"]) == (TOO_MANY, CONTEXT)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/responses", {"input": [USER, {"role": "user", "content": parts(TOO_MANY, "input_text")}]},
     "input[1].content"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": parts(TOO_MANY)}]},
     "input[0].output"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "user", "content": parts(TOO_MANY)}]},
     "messages[1].content"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "assistant", "tool_calls": [call()] * TOO_MANY}]},
     "messages[1].tool_calls"),
    ("/apply-template", {"messages": [{"role": "user", "content": parts(TOO_MANY)}]}, "messages[0].content"),
])
def test_a_nested_list_longer_than_the_context_is_a_400_naming_its_path(path, body, param):
    status, answer = posted(path, body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert answer["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body,where", [
    ({"messages": [{"role": "user", "content": parts(TOO_MANY)}]}, "messages[0].content"),
    ({"messages": [USER], "system": parts(TOO_MANY)}, "system"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": parts(TOO_MANY)}]}]}, "messages[0].content[0].content"),
])
def test_anthropic_blocks_beyond_the_context_are_a_400_in_anthropics_shape_naming_their_path(body, where):
    status, answer = posted("/v1/messages", {"max_tokens": 4, **body})
    assert status == 400 and answer["type"] == "error", answer
    assert answer["error"]["message"].startswith(f"request ({TOO_MANY} tokens) exceeds") and where in \
        answer["error"]["message"], answer


def test_lists_each_within_the_context_but_more_together_are_a_400_naming_where_the_count_went_over():
    # 10 messages and 10 parts each: 110 prompt items, each a token at least, in a context of 100.
    status, answer = posted("/v1/chat/completions", {"messages": [{"role": "user", "content": parts(10)}] * 10})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert answer["error"]["param"] == "messages[8].content"  # 10 + 9 x 10 = 100 > 99: the ninth message's parts


def test_a_list_beyond_its_bound_is_refused_without_validating_it(monkeypatch):
    validated = []
    monkeypatch.setattr(ResponsesBody, "model_validate", classmethod(lambda cls, data: validated.append(data)))
    raw = json.dumps({"input": [{"role": "user", "content": parts(TOO_MANY, "input_text")}]}).encode()
    with pytest.raises(BadRequest) as refused:
        asyncio.run(parse_body(raw, ResponsesBody, BodyLimits(CONTEXT, 10)))
    assert refused.value.param == "input[0].content" and not validated


def test_lists_within_their_bounds_pass_the_shape_check():
    # Two items and their parts: as many prompt items as the context holds tokens, less one for the answer.
    check_shape({"input": [{"role": "user", "content": parts((CONTEXT - 1 - 2) // 2)}] * 2}, BodyLimits(CONTEXT, 10))
    check_shape({"messages": [{"role": "assistant", "tool_calls": [call("c" * MAX_ID_LENGTH, "f" * MAX_NAME_LENGTH)]}],
                 "tools": [{"type": "function", "function": {"name": "f" * MAX_NAME_LENGTH}}]},
                BodyLimits(CONTEXT, 10))


@pytest.mark.parametrize("body,param", [
    ({"output_config": {"format": {"type": "json_schema", "schema": "WIDE"}}}, "output_config.format.schema"),
    ({"output_format": {"type": "json_schema", "schema": "WIDE"}}, "output_format.schema"),
    ({"tools": [{"type": "namespace", "name": "n",
                 "tools": [{"type": "function", "name": "f", "parameters": "WIDE"}]}]},
     "tools[0].tools[0].parameters"),
])
def test_the_schemas_messages_and_responses_take_are_bounded_at_their_top_before_validation(body, param):
    wide = {"type": "object", "properties": {}, **{f"k{i}": 1 for i in range(MAX_OBJECT_KEYS + 1)}}
    raw = json.loads(json.dumps(body).replace('"WIDE"', json.dumps(wide)))
    with pytest.raises(BadRequest) as refused:
        check_shape(raw, BodyLimits(CONTEXT, 10))
    assert refused.value.param == param


@pytest.mark.parametrize("namespace,param", [
    ({"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "f"}] * (MAX_TOOLS + 1)},
     "tools[0].tools"),
    ({"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "f" * (MAX_NAME_LENGTH + 1)}]},
     "tools[0].tools[0].name"),
])
def test_a_responses_namespace_is_bounded_as_the_tools_list_is_before_validation(namespace, param):
    with pytest.raises(BadRequest) as refused:
        check_shape({"input": "hi", "tools": [namespace]}, BodyLimits(CONTEXT, 10))
    assert refused.value.param == param


def test_a_conversation_held_and_continued_with_more_messages_than_the_context_holds_is_too_long():
    held = tuple([USER] * (CONTEXT // 2))  # each turn fit; together they cannot
    body = ResponsesBody.model_validate({"input": [USER] * (CONTEXT // 2), "previous_response_id": "resp_1"})
    with pytest.raises(BadRequest) as refused:
        ResponsesApi(answering=None)._translated(body, held, ResponsesTools(()), CONTEXT)  # type: ignore[arg-type]
    assert refused.value.param == "input" and refused.value.details["n_prompt_tokens"] == CONTEXT


def event_loop_gap(raw: bytes, kind: type, limits: BodyLimits) -> float:
    """The longest the event loop went without running while parse_body read `raw` on its worker thread."""
    async def run() -> float:
        worst, done = 0.0, threading.Event()

        async def tick() -> None:
            nonlocal worst
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                worst, last = max(worst, now - last), now

        ticker = asyncio.create_task(tick())
        try:
            await parse_body(raw, kind, limits)
        except BadRequest:
            pass  # the refusal is what is expected; the gap is what is measured
        finally:
            done.set()
            await ticker
        return worst

    return asyncio.run(run())


@pytest.mark.parametrize("body", [
    {"input": [USER] * 135_000},  # the issue's: 135,000 input items
    {"input": [{"role": "user", "content": parts(135_000, "input_text")}]},  # one item's parts
    {"input": [{"role": "user", "content": parts(3_000, "input_text")}] * 45},  # each fits, not together
])
def test_a_body_of_megabytes_beyond_the_context_stalls_the_event_loop_less_than_reading_its_json(body):
    raw = json.dumps(body).encode()
    began = time.perf_counter()
    json.loads(raw)
    reading = time.perf_counter() - began  # this machine's pace, as a yardstick: the parser lets the loop run
    gap = event_loop_gap(raw, ResponsesBody, BodyLimits(4096, 150_000))
    # Validated before it was refused (pydantic's one call holds the GIL), the body stalled the loop 4-9 times as
    # long as reading its JSON took (0.9-1.2 s); refused first, about a tenth of it (12-18 ms).
    assert gap < reading + 0.02, f"the event loop stalled {gap * 1000:.0f} ms; reading took {reading * 1000:.0f}"


# --- item 4: names and ids nobody renders long ------------------------------------------------------------------

LONG = max(MAX_ID_LENGTH, MAX_NAME_LENGTH) + 1
LONG_ID, LONG_NAME = "c" * LONG, "f" * LONG


@pytest.mark.parametrize("path,body,param", [
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": LONG_ID, "output": "42"}]},
     "input[0].call_id"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": LONG_NAME, "arguments": "{}"}]},
     "input[0].name"),
    ("/v1/responses", {"input": "hi", "previous_response_id": LONG_ID}, "previous_response_id"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": LONG_NAME}]}, "tools[0].name"),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "function", "name": LONG_NAME}}, "tool_choice.name"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "assistant", "tool_calls": [call(LONG_ID)]}]},
     "messages[1].tool_calls[0].id"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "assistant", "tool_calls": [call(name=LONG_NAME)]}]},
     "messages[1].tool_calls[0].function.name"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "tool", "tool_call_id": LONG_ID, "content": "42"}]},
     "messages[1].tool_call_id"),
    ("/v1/chat/completions", {"messages": [{**USER, "name": LONG_NAME}]}, "messages[0].name"),
    ("/v1/chat/completions", {"messages": [USER], "tools": [{"type": "function", "function": {"name": LONG_NAME}}]},
     "tools[0].function.name"),
    ("/v1/chat/completions", {"messages": [USER], "tool_choice": {"type": "function",
                                                                 "function": {"name": LONG_NAME}}},
     "tool_choice.function.name"),
])
def test_a_name_or_id_longer_than_any_client_sends_is_a_400_naming_it(path, body, param):
    status, answer = posted(path, body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert f"holds {LONG} characters" in answer["error"]["message"]


@pytest.mark.parametrize("block,where", [
    ({"type": "tool_use", "id": LONG_ID, "name": "f", "input": {}}, "messages[1].content[0].id"),
    ({"type": "tool_use", "id": "toolu_1", "name": LONG_NAME, "input": {}}, "messages[1].content[0].name"),
])
def test_a_long_tool_use_id_or_name_is_a_400_in_anthropics_shape_naming_it(block, where):
    status, answer = posted("/v1/messages", {"max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [block]}]})
    assert status == 400 and answer["error"]["message"].startswith(f"{where} holds"), answer


def test_what_the_template_writes_raw_is_never_tokenized_beyond_what_the_context_could_hold(target_model,
                                                                                            monkeypatch):
    """A tool call's arguments far longer than the context: refused as too long before they are tokenized (tokenizing
    4 MB of them took 20 s to answer the same 400)."""
    preparer = Preparer(target_model, 512)
    tokenized: list[int] = []
    tokenize = target_model.tokenize
    monkeypatch.setattr(target_model, "tokenize",
                        lambda text, **kw: tokenized.append(len(text)) or tokenize(text, **kw))
    arguments = json.dumps({"a": "x" * (preparer.max_prompt_bytes + 1)})
    chat = ChatBody.model_validate({"messages": [USER, {"role": "assistant", "tool_calls": [
        {**call(), "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "r"}], "max_tokens": 2})
    with pytest.raises(BadRequest) as refused:
        preparer.prepare(chat.to_request())
    assert refused.value.code == "context_length_exceeded"
    assert max(tokenized, default=0) <= preparer.max_prompt_bytes, tokenized


def test_a_megabyte_call_id_is_refused_at_once_by_a_served_target(served_alone):
    """It was checked for control tokens, as the template might write it: tokenizing it took seconds (4 MB: 20 s)."""
    body = {"input": [USER, {"type": "function_call_output", "call_id": "c" * 1_000_000, "output": "42"}]}
    began = time.perf_counter()
    response = post(served_alone, "/v1/responses", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input[1].call_id", response.text
    assert time.perf_counter() - began < 2.0


def held_characters(store: ResponseStore, ids: list[str]) -> int:
    """The characters of every string the store still holds, as JSON (no escapes in these: at least as long)."""
    total = 0
    for response_id in ids:
        try:
            total += len(json.dumps(store.conversation(response_id)))
        except BadRequest:
            continue  # dropped for newer ones
    return total


def test_the_store_counts_what_it_holds_that_no_template_renders():
    store = ResponseStore(max_characters=4 * 1024 * 1024)
    ids = [f"resp_{i}" for i in range(64)]
    for i, response_id in enumerate(ids):  # each turn's id and name 256 KB, which no template writes
        big = f"{i}" + "x" * 256 * 1024
        turn = ({"role": "assistant", "content": "", "tool_calls": [{"id": big, "type": "function",
                                                                    "function": {"name": big, "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": big, "content": "42"})
        store.keep(response_id, turn, characters(turn))
    assert 0 < held_characters(store, ids) <= store.max_characters


# --- item 7: ignored field names are kept clipped ---------------------------------------------------------------

def test_huge_unknown_field_names_keep_no_more_than_their_clipped_log_lines(monkeypatch):
    monkeypatch.setattr(bodies, "_ignored_seen", set())
    size = 100_000
    for i in range(40):
        ChatBody.model_validate({"messages": [USER], f"{i}" + "n" * size: 1}).check_supported()
    kept = sum(len(name) for name in bodies._ignored_seen)
    assert len(bodies._ignored_seen) == 40 and kept < size, kept  # forty names keep less than one of them
