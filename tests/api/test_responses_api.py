"""OpenAI's Responses API (POST /v1/responses) as the openai SDK, Codex CLI and the Agents SDK use it, served by
duo with its draft attached: text, streams, tool calls and their results, structured output, previous_response_id,
and the errors that name what duo cannot do."""

from __future__ import annotations

import asyncio
import json
import uuid

import openai
import pytest

from duo.api.output.deltas import CallArguments, CallClosed, CallOpened, ReasoningDelta, TextDelta
from duo.api.responses.answer import ResponsesFormat
from duo.api.responses.body import ResponsesBody
from duo.api.responses.items import OutputItems
from duo.api.tools import ToolCall
from helpers.http import client, model_name, responses_events, sse_events
from helpers.structured import Address, Person

ASK = "What is the weather in Paris for the next 3 days?"
# A function tool in the Responses shape: flat, not nested under `function`. Strings and numbers are bounded so
# that the tiny random-weight model's call ends.
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}


def drafts_accepted(response: dict | openai.BaseModel) -> int:
    stats = response["duo_stats"] if isinstance(response, dict) else response.model_extra["duo_stats"]
    assert stats["draft_connected"]
    return stats["draft_tokens_accepted"]


# --- output items from an answer's deltas (no model) ------------------------------------------------------------


def test_text_calls_and_text_become_items_each_added_filled_and_done_in_turn():
    call = ToolCall("call_1", "get_weather", '{"city": "Paris", "days": 3}')
    items = OutputItems()
    events = items.feed([TextDelta("Let me look."), TextDelta("\n"), CallOpened(0, call.id, call.name),
                         CallArguments(0, '{"city": "Paris", '), CallArguments(0, '"days": 3}'), CallClosed(0, call),
                         TextDelta("\n")])
    events += items.finish("completed")
    assert [item["type"] for item in items.items] == ["message", "function_call"]
    message, function_call = items.items
    assert message["content"][0]["text"] == "Let me look.\n" and message["status"] == "completed"
    assert function_call["arguments"] == call.arguments and function_call["call_id"] == "call_1"
    assert [event["type"] for event in events] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    assert "".join(e["delta"] for e in events if e["type"].endswith("arguments.delta")) == call.arguments
    assert {e["output_index"] for e in events[7:]} == {1}  # the trailing line break opened no message


def test_an_answer_cut_by_the_length_leaves_its_last_item_incomplete():
    items = OutputItems()
    items.feed([TextDelta("Once upon")])
    done = items.finish("incomplete")
    assert done[-1]["item"]["status"] == "incomplete" and items.items[0]["content"][0]["text"] == "Once upon"


def test_reasoning_comes_before_the_answer_in_an_item_of_its_own():
    items = OutputItems()
    events = items.feed([ReasoningDelta("The user greets."), TextDelta("Hello!")]) + items.finish("completed")
    assert [(item["type"], item["content"][0]["text"]) for item in items.items] == [
        ("reasoning", "The user greets."), ("message", "Hello!")]
    assert [e["type"] for e in events if e["type"].endswith("delta")] == ["response.reasoning_text.delta",
                                                                        "response.output_text.delta"]


async def failing_completion():
    raise RuntimeError("the model broke")
    yield  # an async generator


def test_a_stream_that_fails_ends_with_an_error_event_and_response_failed():
    async def events() -> list[str]:
        stream = ResponsesFormat("tiny", ResponsesBody().echo(), None, None).events(failing_completion(), False)
        return [event async for event in stream]

    sent = sse_events("".join(asyncio.run(events())).splitlines(), done=False)
    assert [event["type"] for event in sent] == ["response.created", "response.in_progress", "error",
                                                 "response.failed"]
    assert "the model broke" in sent[2]["message"] and sent[3]["response"]["status"] == "failed"
    assert sent[3]["response"]["error"]["code"] == "server_error"


# --- text --------------------------------------------------------------------------------------------------------


def test_a_text_turn_answers_the_same_text_whole_and_streamed_with_drafts_accepted(served_sync):
    api, model = client(served_sync), model_name(served_sync)
    whole = api.responses.create(model=model, input="Once upon a time", instructions="Tell a story.",
                                 max_output_tokens=24, temperature=0)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.output_text
    assert whole.output[0].type == "message" and whole.output[0].content[0].type == "output_text"
    assert whole.usage.input_tokens > 0 and whole.usage.total_tokens == whole.usage.input_tokens + 24
    assert whole.instructions == "Tell a story." and whole.temperature == 0
    assert drafts_accepted(whole) > 0
    events = list(api.responses.create(model=model, input="Once upon a time", instructions="Tell a story.",
                                       max_output_tokens=24, temperature=0, stream=True))
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    last = events[-1]
    assert text == whole.output_text and last.type == "response.incomplete"  # 24 tokens ran out
    assert last.response.output_text == text and last.response.usage.output_tokens == 24
    assert drafts_accepted(last.response) > 0


def test_max_output_tokens_ends_the_response_incomplete(served_sync):
    response = client(served_sync).responses.create(model=model_name(served_sync), input="Count to one hundred.",
                                                    max_output_tokens=5)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5 and response.output[0].status == "incomplete"


# --- structured output ---------------------------------------------------------------------------------------------


def test_the_sdks_parse_gets_a_pydantic_model_with_drafts_accepted(served_sync):
    response = client(served_sync).responses.parse(model=model_name(served_sync), input="Describe a person.",
                                                   text_format=Person, max_output_tokens=120, temperature=0)
    person = response.output_parsed
    assert isinstance(person, Person) and isinstance(person.address, Address)
    assert response.status == "completed" and drafts_accepted(response) > 0


def test_the_sdks_stream_helper_assembles_the_parsed_answer(served_sync):
    with client(served_sync).responses.stream(model=model_name(served_sync), input="Describe a person.",
                                              text_format=Person, max_output_tokens=120, temperature=0.7,
                                              extra_body={"seed": 5}) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == deltas and Person.model_validate_json(deltas) == final.output_parsed


# --- tools ---------------------------------------------------------------------------------------------------------


def test_a_required_call_streams_through_the_sdk_into_the_same_call_as_whole(served_sync):
    fields = {"model": model_name(served_sync), "input": ASK, "tools": [WEATHER], "tool_choice": "required",
              "max_output_tokens": 80, "temperature": 0}
    whole = client(served_sync).responses.create(**fields)
    with client(served_sync).responses.stream(**fields) as stream:
        final = stream.get_final_response()
    [call] = [item for item in whole.output if item.type == "function_call"]
    [streamed] = [item for item in final.output if item.type == "function_call"]
    assert call.name == streamed.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == json.loads(streamed.arguments)
    assert set(json.loads(call.arguments)) == {"city", "days"} and drafts_accepted(whole) > 0


def codex_request(model: str, input_: list[dict], tool_choice: str) -> dict:
    """The body Codex CLI posts (codex-rs/codex-api/src/common.rs, ResponsesApiRequest: model, instructions, input,
    tools, tool_choice, parallel_tool_calls, reasoning, store, stream, include, prompt_cache_key), its function
    tool shaped as codex-rs/core/src/client_common.rs's ResponsesApiTool (name, description, strict, parameters);
    its `shell` tool's strings and lists bounded for the tiny model."""
    shell = {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
             "strict": False,
             "parameters": {"type": "object", "additionalProperties": False, "required": ["command"],
                            "properties": {"command": {"type": "array", "maxItems": 2,
                                                       "items": {"type": "string", "maxLength": 8}},
                                           "workdir": {"type": "string", "maxLength": 8}}}}
    return {"model": model, "instructions": "You are a coding agent running in a terminal.", "input": input_,
            "tools": [shell], "tool_choice": tool_choice, "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": str(uuid.uuid4())}


def test_a_codex_turn_makes_a_call_and_answers_its_output(served_sync):
    model = model_name(served_sync)
    user = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}]
    first = responses_events(served_sync, codex_request(model, user, "required"), timeout=60)
    [done] = [e["item"] for e in first if e["type"] == "response.output_item.done" and
              e["item"]["type"] == "function_call"]
    assert done["name"] == "shell" and isinstance(json.loads(done["arguments"])["command"], list)
    assert first[-1]["type"] == "response.completed" and drafts_accepted(first[-1]["response"]) > 0
    # Codex keeps no response on the server (store false): it sends the call and its output back as input items.
    call = {"type": "function_call", "name": done["name"], "arguments": done["arguments"], "call_id": done["call_id"]}
    result = {"type": "function_call_output", "call_id": done["call_id"], "output": "README.md\nsetup.py"}
    second = responses_events(served_sync, {**codex_request(model, user + [call, result], "auto"),
                                            "max_output_tokens": 16}, timeout=60)
    final = second[-1]["response"]
    assert second[-1]["type"] in ("response.completed", "response.incomplete") and final["output"]
    assert final["usage"]["input_tokens"] > first[-1]["response"]["usage"]["input_tokens"]


# --- previous_response_id ------------------------------------------------------------------------------------------


def test_previous_response_id_continues_the_held_conversation(served_sync):
    api, model = client(served_sync), model_name(served_sync)
    first = api.responses.create(model=model, input="Name a fruit.", max_output_tokens=8, temperature=0)
    second = api.responses.create(model=model, previous_response_id=first.id, input="And a vegetable?",
                                  max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    spelled_out = api.responses.create(model=model, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Name a fruit."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "And a vegetable?"}])
    assert second.usage.input_tokens == spelled_out.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == spelled_out.output_text


def test_an_unknown_or_unstored_previous_response_id_is_a_400_naming_it(served_sync):
    api, model = client(served_sync), model_name(served_sync)
    unstored = api.responses.create(model=model, input="Hello", max_output_tokens=2, store=False)
    for response_id in ("resp_unknown", unstored.id):
        with pytest.raises(openai.BadRequestError, match="not held") as raised:
            api.responses.create(model=model, previous_response_id=response_id, input="Hi", max_output_tokens=2)
        assert raised.value.body["param"] == "previous_response_id"


# --- what duo cannot do ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER, {"type": "hosted_thing"}]}, "tools[1].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"background": True}, "background"),
], ids=["unknown tool type", "image part", "item reference", "text format", "schema missing", "background"])
def test_what_duo_cannot_do_is_a_400_naming_the_field(served_sync, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client(served_sync).responses.create(**{"model": model_name(served_sync), "input": ASK,
                                                "max_output_tokens": 2, **fields})
    assert raised.value.body["param"] == param and param.split("[")[0].split(".")[0] in raised.value.message
