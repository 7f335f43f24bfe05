"""A tool call cut off by max_tokens is no finished call, streamed or whole, on every protocol (issue 51): chat ends
with finish_reason "length" and the Messages API with stop_reason "max_tokens", as llama-server says for any answer
that ran out of tokens (server-task.cpp: "length" unless stopped by EOS or a stop word), and the Responses API's call
item is "incomplete" in its incomplete response. A stream has sent the call's opening before the tokens ran out
(llama-server too); the whole answer is then its text, the call's markup unparsed, as llama.cpp reads a whole answer
whose call does not close. The tiny random model is forced to call `ls` and given too few tokens to finish it."""

from __future__ import annotations

import json
import time

import anthropic
import pytest

from duo.api.anthropic.answer import cut_input
from helpers.http import post, streamed
from helpers.processes import Process
from helpers.waiting import until

LS = {"name": "ls", "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                   "required": ["path"]}}
CUT = 40  # max_tokens: the forced call's head and some of its path, which the random model writes on and on
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CUT, "temperature": 0,
        "tools": [{"type": "function", "function": LS}], "tool_choice": {"type": "function", "function": {"name": "ls"}}}
MESSAGES = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": CUT, "temperature": 0,
            "tools": [{"name": "ls", "input_schema": LS["parameters"]}], "tool_choice": {"type": "tool", "name": "ls"}}
RESPONSES = {"input": "hi", "max_output_tokens": CUT, "temperature": 0, "tools": [{"type": "function", **LS}],
             "tool_choice": {"type": "function", "name": "ls"}}


@pytest.fixture(scope="module")
def served(served_alone: Process) -> Process:
    """served_alone once it compiles a forced call's grammar (its vocabulary is built on a thread from the start)."""
    def compiles() -> bool:
        answered = post(served_alone, "/v1/chat/completions", CHAT)
        time.sleep(0.2)
        return answered.status_code == 200
    until(compiles, served_alone, what="a forced call's grammar compiled within its budget")
    return served_alone


def test_a_streamed_chat_call_cut_by_max_tokens_ends_with_length_as_its_whole_answer_does(served):
    chunks = streamed(served, "/v1/chat/completions", CHAT, timeout=120)
    choices = [choice for chunk in chunks for choice in chunk["choices"]]
    opened = [call for choice in choices for call in choice["delta"].get("tool_calls", []) if "id" in call]
    assert [call["function"]["name"] for call in opened] == ["ls"]  # the call's opening went out before the cut
    arguments = "".join(call["function"]["arguments"] for choice in choices
                        for call in choice["delta"].get("tool_calls", []))
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)  # cut: not a finished call
    assert [choice["finish_reason"] for choice in choices if choice["finish_reason"]] == ["length"]

    whole = post(served, "/v1/chat/completions", CHAT).json()["choices"][0]
    assert whole["finish_reason"] == "length" and "tool_calls" not in whole["message"]
    assert arguments in whole["message"]["content"]  # the same text, unparsed


def test_a_streamed_tool_use_cut_by_max_tokens_stops_on_max_tokens_with_the_input_written(served):
    events = streamed(served, "/v1/messages", MESSAGES, timeout=120)
    [stop] = [event["delta"] for event in events if event["type"] == "message_delta"]
    assert stop["stop_reason"] == "max_tokens"
    [block] = [event["content_block"] for event in events if event["type"] == "content_block_start"]
    assert block["type"] == "tool_use" and block["name"] == "ls"
    written = "".join(event["delta"]["partial_json"] for event in events if event["type"] == "content_block_delta")

    whole = post(served, "/v1/messages", MESSAGES).json()
    assert whole["stop_reason"] == "max_tokens"
    [text] = [block["text"] for block in whole["content"] if block["type"] == "text"]
    assert written in text and json.loads(written + '"}')["path"]  # what the model wrote of its path, as written

    client = anthropic.Anthropic(base_url=served.http_url, api_key="unused", max_retries=0, timeout=120)
    fields = {key: value for key, value in MESSAGES.items() if key != "temperature"}  # (not a stream() argument)
    with client.messages.stream(**fields, extra_body={"temperature": 0}) as stream:
        message = stream.get_final_message()  # the SDK's partial reader completes the input as Anthropic's would
    assert message.stop_reason == "max_tokens"
    assert [(block.type, block.name) for block in message.content] == [("tool_use", "ls")]


def test_a_responses_call_cut_by_max_output_tokens_is_an_incomplete_item_of_an_incomplete_response(served):
    events = streamed(served, "/v1/responses", RESPONSES, timeout=120)
    [done] = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert done["type"] == "function_call" and done["status"] == "incomplete"
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert [item["status"] for item in final["response"]["output"]] == ["incomplete"]

    whole = post(served, "/v1/responses", RESPONSES).json()
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert all(item["status"] == "incomplete" for item in whole["output"])
    assert all(item["type"] != "function_call" for item in whole["output"])  # its text, the call unparsed


@pytest.mark.parametrize("written, sent", [
    ('{"path": "/tm', '{"path": "/tm'),            # inside a string: as written, its quote closes it
    ('{"path": "a", "con', '{"path": "a"'),       # inside a key: up to the value before it
    ('{"path": "a\\', '{"path": "a'),              # an escape's middle is left out
    ('{"path":', "{"),                             # no value yet: the object's opening
    ("{'path': 'a", "{"),                          # no JSON: nothing of it
    ("", "{}"),
])
def test_a_cut_calls_input_is_sent_as_far_as_it_is_the_start_of_a_json_object(written, sent):
    assert cut_input(written) == sent
