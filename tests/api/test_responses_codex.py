"""The Responses API as Codex CLI 0.171 (codex-rs) uses it with its default settings against a custom provider
(wire_api = "responses"): its first turn as it sends it (tools in a namespace, web_search, store false, reasoning
and include), the calls it parses back (a namespaced function's call names its namespace), custom (freeform) tools
such as apply_patch, and the items it sends back on the next turn, served by duo with its draft attached."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from duo.api.http import create_app
from duo.api.output.deltas import CallArguments, CallClosed, CallOpened
from duo.api.responses import answer
from duo.api.responses.answer import output_messages
from duo.api.responses.body import ResponsesBody
from duo.api.responses.items import OutputItems
from duo.api.responses.tools import ResponsesTools, flat_name
from duo.api.responses.translate import chat_body, input_messages
from duo.api.serving.metrics import Metrics
from duo.api.serving.request import BadRequest
from duo.api.tools import ToolCall
from helpers.asgi import asgi_call
from helpers.http import responses_events, sse_events
from helpers.processes import start, wait_for_draft
from helpers.slow_model import SlowCompletions
from helpers.tiny_models import DRAFT_NOISE, DRAFT_SEED, TARGET_SEED, write_tiny_model
from helpers.waiting import until

# The first request Codex CLI 0.171 posted for "create hello.py that prints hello" (model unknown to Codex, as a
# GGUF's name is: its fallback tool set), captured from the real binary; ids and paths replaced.
FIRST_TURN = json.loads((Path(__file__).parents[1] / "data" / "agents" / "codex-0.171-first-turn.json").read_text())
# The issue's minimal body: one namespace of one function.
NAMESPACED = {"input": "hi", "tools": [{"type": "namespace", "name": "ns", "description": "d", "tools": [
    {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]}]}
# apply_patch as Codex offers it to the models it knows (gpt-5.5): a custom tool whose input follows a Lark grammar,
# codex-rs' tool_apply_patch.lark.
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Use the `apply_patch` tool to edit files.",
               "format": {"type": "grammar", "syntax": "lark", "definition": (
                   Path(__file__).parents[1] / "data" / "agents" / "codex-tool_apply_patch.lark").read_text()}}
PATCH = '*** Begin Patch\n*** Add File: hello.py\n+print("hello")\n*** End Patch\n'
# A custom tool whose input follows a regular expression: a constrained call matches it whole.
WORD = {"type": "custom", "name": "say", "description": "Says one word.",
        "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]{1,8}"}}


def later_turn(first: dict, *items: dict) -> dict:
    """The next request of Codex's turn: the same body, its input grown by the items the model made and their
    outputs, each as Codex sends it back (ids, statuses and all)."""
    body = copy.deepcopy(first)
    body["input"] += list(items)
    return body


# --- tools: offered under the names the template shows, calls back in Codex's shape (no model) --------------------


def test_a_namespaces_functions_are_offered_under_flat_names_that_read_back_whole():
    tools = ResponsesTools(ResponsesBody.model_validate(FIRST_TURN).tools)
    names = [tool["function"]["name"] for tool in tools.chat]
    assert "multi_agent_v1.spawn_agent" in names and "multi_agent_v1.close_agent" in names
    assert "exec_command" in names and not any("web_search" in name for name in names)  # OpenAI's servers run it
    assert flat_name("foo.bar", "baz.qux") == "foo..bar.baz..qux" and flat_name(None, "f") == "f"


def test_a_call_of_a_namespaced_function_is_the_item_codex_routes_by_name_and_namespace():
    items = OutputItems(ResponsesTools(ResponsesBody.model_validate(NAMESPACED).tools))
    call = ToolCall("call_1", "ns.f", "{}")
    events = items.feed([CallOpened(0, call.id, call.name), CallArguments(0, "{}"), CallClosed(0, call)])
    events += items.finish("completed")
    [item] = items.items
    assert (item["type"], item["name"], item["namespace"], item["arguments"]) == ("function_call", "f", "ns", "{}")
    assert events[-1]["type"] == "response.output_item.done" and events[-1]["item"]["namespace"] == "ns"
    # Held for previous_response_id, the call reads back under the name the model wrote.
    [message] = output_messages(items.items)
    assert message["tool_calls"][0]["function"]["name"] == "ns.f"


@pytest.mark.parametrize("choice, chat_name", [
    ({"type": "function", "name": "f", "namespace": "ns"}, "ns.f"),
    ({"type": "custom", "name": "apply_patch"}, "apply_patch"),
], ids=["namespaced function", "custom tool"])
def test_tool_choice_names_a_namespaced_function_or_a_custom_tool(choice, chat_name):
    body = ResponsesBody.model_validate({**NAMESPACED, "tools": [*NAMESPACED["tools"], APPLY_PATCH],
                                         "tool_choice": choice})
    body.check_supported()
    chat = chat_body(body, input_messages(body), ResponsesTools(body.tools))
    assert [function.name for function in chat.callable_functions()] == [chat_name]


def test_a_custom_tool_is_a_function_of_one_string_and_its_call_a_custom_tool_call_with_that_input():
    tools = ResponsesTools(ResponsesBody.model_validate({"input": "hi", "tools": [APPLY_PATCH]}).tools)
    [offered] = tools.chat
    assert offered["function"]["parameters"]["required"] == ["input"]
    # A Lark grammar is told the model in the description (a required call is written under it:
    # test_responses_custom_lark.py); a regular expression is the pattern.
    assert "lark grammar" in offered["function"]["description"] and "*** Begin Patch" in offered["function"][
        "description"] and "pattern" not in offered["function"]["parameters"]["properties"]["input"]
    [word] = ResponsesTools(ResponsesBody.model_validate({"input": "hi", "tools": [WORD]}).tools).chat
    assert word["function"]["parameters"]["properties"]["input"] == {"type": "string", "pattern": "^(?:[a-z]{1,8})$"}
    items = OutputItems(tools)
    call = ToolCall("call_2", "apply_patch", json.dumps({"input": PATCH}))
    events = items.feed([CallOpened(0, call.id, call.name), CallArguments(0, call.arguments), CallClosed(0, call)])
    [item] = items.items
    assert (item["type"], item["name"], item["input"], item["call_id"]) == ("custom_tool_call", "apply_patch",
                                                                            PATCH, "call_2")
    assert [event["type"] for event in events] == [
        "response.output_item.added", "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done", "response.output_item.done"]
    assert events[2]["input"] == PATCH and "arguments" not in item


def test_a_custom_tool_in_a_namespace_is_called_by_its_name_and_namespace():
    namespace = {"type": "namespace", "name": "edit", "description": "Editing.", "tools": [APPLY_PATCH]}
    items = OutputItems(ResponsesTools(ResponsesBody.model_validate({"input": "hi", "tools": [namespace]}).tools))
    call = ToolCall("call_3", "edit.apply_patch", json.dumps({"input": PATCH}))
    items.feed([CallOpened(0, call.id, call.name), CallClosed(0, call)])
    [item] = items.items
    assert (item["type"], item["name"], item["namespace"], item["input"]) == ("custom_tool_call", "apply_patch",
                                                                              "edit", PATCH)
    [message] = output_messages(items.items)
    assert message["tool_calls"][0]["function"]["name"] == "edit.apply_patch"


def test_the_items_codex_sends_back_become_the_calls_and_results_the_model_wrote_and_read():
    """Codex's second request (store false) carries its reasoning item, the message and calls the model made and
    their outputs, each as it got them (captured from Codex 0.171)."""
    body = later_turn(
        {**FIRST_TURN, "tools": [*FIRST_TURN["tools"], APPLY_PATCH]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None,
         "content": [{"type": "reasoning_text", "text": "I should write the file."}]},
        {"type": "message", "status": "completed", "id": "msg_a", "role": "assistant",
         "content": [{"type": "output_text", "text": "Writing it.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "status": "completed", "id": "fc_1", "name": "close_agent",
         "namespace": "multi_agent_v1", "arguments": "{\"target\":\"x\"}", "call_id": "call_1"},
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "closed"},
        {"type": "custom_tool_call", "id": "ctc_1", "status": "completed", "call_id": "call_7",
         "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "id": "ctco_1", "call_id": "call_7", "output": "Done!"})
    parsed = ResponsesBody.model_validate(body)
    parsed.check_supported()
    messages = input_messages(parsed)
    assert [m["role"] for m in messages] == ["developer", "developer", "user", "user", "assistant", "tool", "assistant",
                                             "tool"]  # the reasoning dropped, as templates drop earlier reasoning
    assert messages[4]["content"] == "Writing it."
    assert messages[4]["tool_calls"][0]["function"] == {"name": "multi_agent_v1.close_agent",
                                                        "arguments": "{\"target\":\"x\"}"}
    assert json.loads(messages[6]["tool_calls"][0]["function"]["arguments"]) == {"input": PATCH}
    assert (messages[7]["tool_call_id"], messages[7]["content"]) == ("call_7", "Done!")
    chat = chat_body(parsed, messages, ResponsesTools(parsed.tools))
    assert chat.to_request().messages[6]["tool_calls"][0]["function"]["arguments"] == {"input": PATCH}


@pytest.mark.parametrize("tools, param", [
    ([{"type": "hosted_thing"}], "tools[0].type"),
    ([{"type": "namespace", "name": "ns"}], "tools[0].tools"),
    ([{"type": "namespace", "name": "ns", "tools": [NAMESPACED["tools"][0]]}], "tools[0].tools[0].type"),
    ([{"type": "custom", "name": "x", "format": {"type": "image"}}], "tools[0].format.type"),
    ([{"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}}],
     "tools[0].format.syntax"),
    ([{"type": "function", "name": "ns.f"}, NAMESPACED["tools"][0]], "tools"),
], ids=["unknown type", "empty namespace", "namespace in a namespace", "custom format", "grammar syntax",
                             "one name twice"])
def test_tools_duo_cannot_offer_are_refused_naming_the_field(tools, param):
    body = ResponsesBody.model_validate({"input": "hi", "tools": tools})
    with pytest.raises(BadRequest) as raised:
        body.check_supported()
        ResponsesTools(body.tools)
    assert raised.value.param == param


# --- Codex's requests served ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def codex_served(tmp_path_factory: pytest.TempPathFactory, process_logs: Path):
    """duo-target beside its draft on a tiny pair with room for Codex's whole first turn (its instructions and tools
    are some 8k tokens: more than the shared tiny pair's 2k context), synchronous so that every step verifies
    drafts."""
    models = tmp_path_factory.mktemp("codex-models")
    target = write_tiny_model(models / "target.gguf", seed=TARGET_SEED, embedding_type="f32", n_ctx=16384)
    draft = write_tiny_model(models / "draft.gguf", seed=DRAFT_SEED, base=target, noise=DRAFT_NOISE)
    drafts = start("duo.cli.draft", ["--model", str(draft)], process_logs)
    served = start("duo.cli.target", ["--model", str(target), "--peer", drafts.address, "--sync", "4"],
                   process_logs, http=True)
    wait_for_draft(served.address)
    until(lambda: compiles_grammars(served), served, drafts, what="a forced call compiling within its budget")
    yield served
    served.stop()
    drafts.stop()


def compiles_grammars(process) -> bool:
    """Whether a forced call is answered: duo-target builds the vocabulary grammars need as it starts, in the
    background, and on a loaded machine a first grammar can wait past its compile budget for it."""
    closed = {"type": "object", "properties": {}, "additionalProperties": False}
    body = {"input": "hi", "tools": [{"type": "function", "name": "ready", "parameters": closed}],
            "tool_choice": "required", "max_output_tokens": 8}
    return httpx.post(f"{process.http_url}/v1/responses", json=body, timeout=60).status_code == 200


def well_formed(events: list[dict]) -> dict:
    """The final response of a stream whose events are numbered in order, each item added before it is done, and
    which ends completed or incomplete (the length ran out); every done item as the final response holds it."""
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert [event["type"] for event in events[:2]] == ["response.created", "response.in_progress"]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert added == [e["output_index"] for e in done] == list(range(len(done)))
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    assert [e["item"] for e in done] == final["response"]["output"]
    return final["response"]


def drafts_accepted(response: dict) -> int:
    assert response["duo_stats"]["draft_connected"]
    return response["duo_stats"]["draft_tokens_accepted"]


def test_the_issues_minimal_namespace_body_is_answered(codex_served):
    response = httpx.post(f"{codex_served.http_url}/v1/responses", json={**NAMESPACED, "max_output_tokens": 4},
                          timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["tools"] == NAMESPACED["tools"]


def test_a_forced_call_of_a_namespaced_function_comes_back_as_codex_parses_it(codex_served):
    closed = {"type": "object", "properties": {}, "additionalProperties": False}  # so the tiny model's call ends
    namespace = {**NAMESPACED["tools"][0], "tools": [{**NAMESPACED["tools"][0]["tools"][0], "parameters": closed}]}
    body = {**NAMESPACED, "tools": [namespace], "tool_choice": "required", "stream": True, "max_output_tokens": 40,
            "temperature": 0}
    final = well_formed(responses_events(codex_served, body))
    [call] = [item for item in final["output"] if item["type"] == "function_call"]
    assert (call["name"], call["namespace"], json.loads(call["arguments"])) == ("f", "ns", {})
    assert final["status"] == "completed"


def test_codexs_first_turn_as_it_sends_it_streams_a_well_formed_response_with_drafts_accepted(codex_served):
    final = well_formed(responses_events(codex_served, {**FIRST_TURN, "max_output_tokens": 24}))
    assert final["store"] is False and final["tools"][4]["type"] == "namespace"
    assert final["usage"]["input_tokens"] > 4000 and drafts_accepted(final) > 0


def test_codexs_second_turn_after_a_namespaced_call_is_answered(codex_served):
    first = {**FIRST_TURN, "tool_choice": "required", "max_output_tokens": 60, "temperature": 0}
    first["tools"] = [tool for tool in FIRST_TURN["tools"] if tool["type"] != "function"]  # the namespace's only
    [call] = [item for item in well_formed(responses_events(codex_served, first))["output"]
              if item["type"] == "function_call"]
    assert call["namespace"] == "multi_agent_v1"
    sent_back = {key: call[key] for key in ("type", "id", "status", "name", "namespace", "arguments", "call_id")}
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "no such agent"}
    final = well_formed(responses_events(codex_served, {**later_turn(FIRST_TURN, sent_back, result),
                                              "max_output_tokens": 16}))
    assert final["usage"]["input_tokens"] > 4000 and drafts_accepted(final) > 0


def test_a_custom_tool_call_round_trips(codex_served):
    body = {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                       "text": "Say a word."}]}],
            "tools": [WORD, {"type": "web_search", "external_web_access": False}], "tool_choice": "required",
            "store": False, "stream": True, "max_output_tokens": 60, "temperature": 0}
    first = well_formed(responses_events(codex_served, body))
    [call] = [item for item in first["output"] if item["type"] == "custom_tool_call"]
    assert call["name"] == "say" and re.fullmatch("[a-z]{1,8}", call["input"])
    assert first["status"] == "completed" and drafts_accepted(first) > 0
    sent_back = {key: call[key] for key in ("type", "id", "status", "call_id", "name", "input")}
    result = {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Said."}
    second = well_formed(responses_events(codex_served, {**body, "input": [*body["input"], sent_back, result],
                                               "tool_choice": "auto", "max_output_tokens": 8}))
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]


@pytest.mark.parametrize("choice, kind, read", [
    ({"type": "function", "namespace": "ns", "name": "f"}, "function_call", "arguments"),
    ({"type": "custom", "namespace": "ns", "name": "say"}, "custom_tool_call", "input"),
], ids=["namespaced function", "namespaced custom tool"])
def test_the_openai_sdk_reads_a_namespaced_call_whole_and_streamed_alike(codex_served, choice, kind, read):
    closed = {"type": "object", "properties": {}, "additionalProperties": False}
    namespace = {"type": "namespace", "name": "ns", "description": "d",
                 "tools": [{"type": "function", "name": "f", "parameters": closed}, WORD]}
    api = openai.OpenAI(base_url=f"{codex_served.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    fields = {"model": "tiny", "input": "Say a word.", "tools": [namespace], "tool_choice": choice,
              "max_output_tokens": 60, "temperature": 0}
    whole = api.responses.create(**fields)
    with api.responses.stream(**fields) as stream:
        streamed = stream.get_final_response()
    [call], [same] = ([item for item in response.output if item.type == kind] for response in (whole, streamed))
    assert (call.namespace, call.name) == (same.namespace, same.name) == ("ns", choice["name"])
    assert getattr(call, read) == getattr(same, read) and whole.status == streamed.status == "completed"


# --- a slow target: the stream says it is alive while the prompt is read --------------------------------------------

def slow_response_events(prompt_s: float) -> list[dict]:
    """The events of a streamed response from a model that reads its prompt for `prompt_s` seconds."""
    app = create_app(SlowCompletions(["Hel", "lo."], prompt_s, 0.0), Metrics(), None)

    raw = asgi_call(app, "POST", "/v1/responses", json={"model": "m", "input": "hi", "stream": True})
    return sse_events(raw.text.splitlines(), done=False)


def test_while_the_prompt_is_read_the_stream_says_it_is_in_progress_so_codexs_idle_timeout_does_not_fire(
        monkeypatch):
    monkeypatch.setattr(answer, "KEEPALIVE_S", 0.05)
    events = slow_response_events(prompt_s=0.5)
    kinds = [event["type"] for event in events]
    first_item = kinds.index("response.output_item.added")
    assert kinds[0] == "response.created" and first_item >= 6, kinds  # in progress, then again while read for 0.5 s
    assert set(kinds[1:first_item]) == {"response.in_progress"}, kinds
    assert kinds[-1] == "response.completed" and events[-1]["response"]["output"][0]["content"][0]["text"] == "Hello."
    assert [event["sequence_number"] for event in events] == list(range(len(events)))


def test_a_stream_that_never_waits_long_says_in_progress_once():
    kinds = [event["type"] for event in slow_response_events(prompt_s=0)]
    assert kinds.count("response.in_progress") == 1 and kinds[:2] == ["response.created", "response.in_progress"]
