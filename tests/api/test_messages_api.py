"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): its translation to chat and its events checked
without a model, then driven by the anthropic SDK against duo with its draft."""

from __future__ import annotations

import copy
import json

import anthropic
import httpx
import pytest

from duo.api.output.deltas import CallArguments, CallClosed, CallOpened, ReasoningDelta, TextDelta
from duo.api.anthropic.answer import ContentBlocks, assembled
from duo.api.serving.stop import StopMatcher
from duo.api.anthropic.body import MessagesBody
from duo.api.anthropic.translate import chat_body
from duo.api.serving.request import BadRequest
from duo.api.tools import ToolCall
from helpers.http import LEAVE_EARLY_TOKENS, generated_tokens, health, model_name, post, stop_inside, wait_until_idle

# A Claude Code turn as it goes over the wire, after the capture of claude-cli 2.0.36 in tianzecn/myclaudecode
# (mcp/claudish/ai_docs/CLAUDE_CODE_PROTOCOL_COMPLETE.md, "Request Body Structure"): system and user text blocks
# marked cache_control ephemeral, the CLAUDE.md context as a <system-reminder> block before the question,
# metadata.user_id, max_tokens 32000 and stream true; the system's billing header as llama.cpp PR 21793 quotes it;
# thinking as Claude Code turns it on. The tool is Claude Code's Read, but for maxLength on file_path: the tiny
# random-weight model would write the path until its context ends.
READ_TOOL = {
    "name": "Read",
    "description": "Reads a file from the local filesystem. You can access any file directly by using this tool.",
    "input_schema": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                     "properties": {"file_path": {"type": "string", "maxLength": 24,
                                                  "description": "The absolute path to the file to read"}},
                     "required": ["file_path"], "additionalProperties": False},
}
CLAUDE_CODE_TURN = {
    "model": "claude-sonnet-4-5-20250929",  # any name is duo's one model, as llama-server serves any
    "max_tokens": 32000,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;"},
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
         "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nAs you answer, use this context: the project is duo."
                                 "\n</system-reminder>", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Read package.json", "cache_control": {"type": "ephemeral"}},
    ]}],
    "tools": [READ_TOOL],
    "metadata": {"user_id": "user_f925af13bf4d0fe65c090d75dbee55fca59693b4c4cbeb48994578dda58eb051"},
    "thinking": {"type": "enabled", "budget_tokens": 31999},
    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},  # so that the random model calls one
}
ASK = [{"role": "user", "content": "tell me a story"}]
# The SDK warns that the captured turn's model is to retire; duo serves it as any name.
pytestmark = pytest.mark.filterwarnings("ignore:The model .* is deprecated:DeprecationWarning")
GREEDY = {"extra_body": {"temperature": 0}}  # this SDK's create() has no temperature argument; the API takes one


def anthropic_client(process) -> anthropic.Anthropic:
    # No retries: a test must see the first answer, errors included.
    return anthropic.Anthropic(base_url=process.http_url, api_key="unused", max_retries=0, timeout=120)


def turn_with_result(call: dict) -> dict:
    """CLAUDE_CODE_TURN with the model's call and the tool's result sent back, as Claude Code sends them."""
    turn = copy.deepcopy(CLAUDE_CODE_TURN)
    del turn["tool_choice"]  # Claude Code sends none
    turn["messages"] += [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "The user wants a file.", "signature": "x"},
                                          call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                      "content": '     1\t{\n     2\t  "name": "duo"\n     3\t}'}]}]
    return turn


# --- translation and events, without a model ----------------------------------------------------------------------

def test_a_claude_code_turn_is_the_chat_request_of_its_system_messages_tools_and_choice():
    call = {"type": "tool_use", "id": "toolu_0123456789abcdef", "name": "Read", "input": {"file_path": "/p.json"}}
    chat = chat_body(MessagesBody.model_validate({**turn_with_result(call), "tool_choice": CLAUDE_CODE_TURN[
        "tool_choice"]}))
    system, question, answer, result = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert system == {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1.101.e51; "
                                                   "cc_entrypoint=cli; \nYou are Claude Code, Anthropic's official "
                                                   "CLI for Claude."}  # the stamp that changes every request is out
    assert question["role"] == "user" and question["content"].endswith("</system-reminder>\nRead package.json")
    assert answer["role"] == "assistant" and answer["content"] == ""
    assert answer["reasoning_content"] == "The user wants a file."  # its thinking kept, as llama-server keeps it
    [tool_call] = answer["tool_calls"]
    assert tool_call["id"] == "0123456789abcdef" and tool_call["function"]["name"] == "Read"
    assert json.loads(tool_call["function"]["arguments"]) == {"file_path": "/p.json"}
    assert result == {"role": "tool", "tool_call_id": "0123456789abcdef",
                      "content": '     1\t{\n     2\t  "name": "duo"\n     3\t}'}
    assert [tool.model_dump(exclude_none=True) for tool in chat.tools] == [
        {"type": "function", "function": {"name": "Read", "description": READ_TOOL["description"],
                                          "parameters": READ_TOOL["input_schema"]}}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.max_tokens == 32000 and chat.stream is False
    assert chat.chat_template_kwargs == {"enable_thinking": True}  # templates that reason read it


@pytest.mark.parametrize("change, where", [
    (lambda b: b["messages"][0]["content"].append(
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}),
     "messages[0].content[2] is a block of type 'image'"),
    (lambda b: b["messages"].append({"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}),
     "messages[1].content[0]: a tool_result block belongs in a user message"),
    (lambda b: b["tools"].append({"type": "web_search_20250305", "name": "web_search", "max_uses": 5}),
     "tools[1] is Anthropic's server tool 'web_search_20250305'"),
    (lambda b: b.update(tool_choice={"type": "tool"}), "tool_choice of type tool needs name"),
], ids=["image", "result from the assistant", "server tool", "tool choice without a name"])
def test_what_duo_cannot_render_is_refused_naming_it(change, where):
    body = copy.deepcopy(CLAUDE_CODE_TURN)
    change(body)
    with pytest.raises(BadRequest, match=where.replace("[", r"\[").replace("]", r"\]")):
        chat_body(MessagesBody.model_validate(body))


def test_deltas_become_blocks_numbered_as_they_open_which_assemble_into_the_whole_content():
    blocks = ContentBlocks()
    first, second = ToolCall("call_a1", "Read", '{"file_path": "/p"}'), ToolCall("call_b2", "Read", "{}")
    deltas = [ReasoningDelta("Hm, "), ReasoningDelta("a file."), TextDelta("Reading."), CallOpened(0, first.id, "Read"),
              CallArguments(0, '{"file_path": '), CallArguments(0, '"/p"}'), CallClosed(0, first),
              CallOpened(1, second.id, "Read"), CallArguments(1, "{}"), CallClosed(1, second)]
    events = blocks.feed(deltas) + blocks.close()
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use")]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2, 3]
    assert blocks.calls == 2
    assert assembled(events) == [
        {"type": "thinking", "thinking": "Hm, a file.", "signature": ""}, {"type": "text", "text": "Reading."},
        {"type": "tool_use", "id": "toolu_a1", "name": "Read", "input": {"file_path": "/p"}},
        {"type": "tool_use", "id": "toolu_b2", "name": "Read", "input": {}}]


def test_the_stop_sequence_named_is_the_one_that_ended_the_text():
    matcher = StopMatcher(["END", "once", "on"])
    assert matcher.feed("Once upon a time o") == ("Once up", True) and matcher.word == "on"
    matcher = StopMatcher(["END", "ce m", "once"])
    assert matcher.feed("Once upon a time once more") == ("Once upon a time ", True) and matcher.word == "once"
    assert StopMatcher(["END"]).word == ""


# --- served: the anthropic SDK against duo with its draft ---------------------------------------------------------

def test_a_plain_turn_answers_the_chats_greedy_text_whole_and_streamed_with_drafts_accepted(served_sync):
    model = model_name(served_sync)
    chat = post(served_sync, "/v1/chat/completions", {"messages": ASK, "max_tokens": 20, "temperature": 0}).json()
    whole = anthropic_client(served_sync).messages.create(model=model, messages=ASK, max_tokens=20, **GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.model == model and [block.type for block in whole.content] == ["text"]
    assert whole.content[0].text == chat["choices"][0]["message"]["content"]
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.output_tokens == 20
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    assert whole.model_extra["duo_stats"]["draft_tokens_accepted"] > 0

    with anthropic_client(served_sync).messages.stream(model=model, messages=ASK, max_tokens=20,
                                                       **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [e.type for e in events if e.type.startswith("message")] == ["message_start", "message_delta",
                                                                       "message_stop"]
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 20
    [delta] = [e for e in events if e.type == "message_delta"]
    assert delta.model_extra["duo_stats"]["draft_tokens_accepted"] > 0


def test_a_claude_code_turn_calls_a_tool_then_answers_its_result_streamed_with_drafts_accepted(served_sync):
    client = anthropic_client(served_sync)
    turn = CLAUDE_CODE_TURN
    with client.messages.stream(**turn) as stream:
        deltas = [e for e in stream if e.type == "message_delta"]
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use" and first.model == "claude-sonnet-4-5-20250929"
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "Read" and call.id.startswith("toolu_") and set(call.input) == {"file_path"}
    assert deltas[0].model_extra["duo_stats"]["draft_tokens_accepted"] > 0

    # The result goes back with the call (and a thinking block, its reasoning); the answer is cut short, as the random
    # model would not end it soon.
    second_turn = {**turn_with_result(call.model_dump(exclude_none=True)), "max_tokens": 24}
    with client.messages.stream(**second_turn) as stream:
        deltas = [e for e in stream if e.type == "message_delta"]
        second = stream.get_final_message()
    assert second.stop_reason in ("max_tokens", "end_turn", "tool_use") and second.usage.output_tokens > 0
    assert second.content and deltas[0].model_extra["duo_stats"]["draft_tokens_accepted"] > 0
    prompt = [m.usage.input_tokens + m.usage.cache_read_input_tokens for m in (first, second)]
    assert prompt[1] > prompt[0]  # the call and its result are in the second prompt
    assert second.usage.cache_read_input_tokens > 0  # the turn before is its prefix: the billing stamp is out


def test_count_tokens_is_the_prompt_that_the_same_request_reads(served_sync):
    client = anthropic_client(served_sync)
    turn = {**CLAUDE_CODE_TURN, "max_tokens": 40}
    counted = client.messages.count_tokens(**{k: v for k, v in turn.items() if k not in ("max_tokens", "metadata")})
    answer = client.messages.create(**turn)
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens > 30
    without_tools = client.messages.count_tokens(model=turn["model"], messages=turn["messages"],
                                                 system=turn["system"])
    assert without_tools.input_tokens < counted.input_tokens  # the tools are part of the prompt


def test_a_stop_sequence_ends_the_answer_before_it_and_is_named(served_sync):
    client = anthropic_client(served_sync)
    model = model_name(served_sync)
    full = client.messages.create(model=model, messages=ASK, max_tokens=40, **GREEDY).content[0].text
    stop = stop_inside(full)
    answer = client.messages.create(model=model, messages=ASK, max_tokens=40, **GREEDY,
                                    stop_sequences=["never appears", stop])
    assert answer.content[0].text == full[:full.index(stop)]
    assert answer.stop_reason == "stop_sequence" and answer.stop_sequence == stop
    with client.messages.stream(model=model, messages=ASK, max_tokens=40, **GREEDY,
                                stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop


def test_an_image_block_is_a_400_in_anthropics_error_shape(served_sync):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    with pytest.raises(anthropic.BadRequestError) as raised:
        anthropic_client(served_sync).messages.create(model=model_name(served_sync), messages=messages, max_tokens=8)
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0] is a block of type 'image'" in raised.value.body["error"]["message"]


@pytest.mark.parametrize("path, body, status, kind", [
    ("/v1/messages", {"messages": ASK}, 400, "invalid_request_error"),
    ("/v1/messages/count_tokens", {"messages": "hello"}, 400, "invalid_request_error"),
    ("/v1/messages/nothing", {}, 404, "not_found_error"),
], ids=["no max_tokens", "messages not a list", "no such route"])
def test_errors_on_the_messages_routes_are_in_anthropics_shape(served_sync, path, body, status, kind):
    response = post(served_sync, path, body)
    assert response.status_code == status, response.text
    answer = response.json()
    assert answer["type"] == "error" and answer["error"]["type"] == kind and answer["error"]["message"]


def test_a_client_that_leaves_a_messages_stream_frees_its_session_and_the_drafts(served_sync):
    before = generated_tokens(served_sync)
    body = {"messages": ASK, "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served_sync.http_url}/v1/messages", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: message_start"
        for _ in range(6):
            next(lines)
        assert health(served_sync)["draft_sessions"] == 1
    wait_until_idle(served_sync)
    assert generated_tokens(served_sync) - before < LEAVE_EARLY_TOKENS
