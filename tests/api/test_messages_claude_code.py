"""Claude Code 2.1.197 as it talks to duo with its default settings: the bodies it sends (captured from `claude -p`
against a recording server: a system message in the middle of `messages`, adaptive thinking, context_management,
output_config, metadata, cache_control on system blocks and the last message, `?beta=true` and its anthropic-beta
list on every path, a title request whose output_config.format is a JSON schema) translated without a model, then
answered by duo with its draft and read by the anthropic SDK's beta client, as Claude Code reads them; the errors
Claude Code acts on (a system message the template refuses, a prompt too long) in the words it looks for; and a
slow model's stream kept alive by pings for Claude Code's idle watchdog."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import httpx2
import pytest

from duo.api.anthropic import answer
from duo.api.anthropic.body import CountTokensBody, MessagesBody
from duo.api.anthropic.translate import chat_body
from duo.api.http import create_app
from duo.api.serving.metrics import Metrics
from duo.api.serving.request import BadRequest
from helpers.http import post
from helpers.slow_model import SlowCompletions
from helpers.processes import Process, start
from helpers.tiny_models import write_tiny_model
from helpers.waiting import until

# The anthropic-beta header of its first turn (the SDK sends it with ?beta=true on the path).
BETAS = ["claude-code-20250219", "context-1m-2025-08-07", "interleaved-thinking-2025-05-14",
         "thinking-token-count-2026-05-13", "context-management-2025-06-27", "prompt-caching-scope-2026-01-05",
         "mid-conversation-system-2026-04-07", "effort-2025-11-24"]
# Claude Code's Write tool as it sends it, but for maxLength on its strings: the tiny random-weight model would
# write them until its context ends.
WRITE_TOOL = {
    "name": "Write",
    "description": "Writes a file to the local filesystem, overwriting if one exists.",
    "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": {
        "file_path": {"description": "The absolute path to the file to write (must be absolute, not relative)",
                      "type": "string", "maxLength": 16},
        "content": {"description": "The content to write to the file", "type": "string", "maxLength": 16}},
        "required": ["file_path", "content"], "additionalProperties": False},
}
BASH_TOOL = {
    "name": "Bash",
    "description": "Executes a bash command and returns its output.",
    "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": {
        "command": {"description": "The command to execute", "type": "string"},
        "timeout": {"description": "Optional timeout in milliseconds (max 600000)", "type": "number"}},
        "required": ["command"], "additionalProperties": False},
}
# Its first turn, field for field as captured (the texts shortened: the tiny models' context is 2048 tokens, Claude
# Code's own prompt about 18k), less `stream`, which the SDK's stream() sets.
FIRST_TURN = {
    "model": "claude-opus-4-8",
    "max_tokens": 64000,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.7f9; cc_entrypoint=sdk-cli;"},
        {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.",
         "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "\nYou are an interactive agent that helps users with software engineering tasks.",
         "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use the following "
                                     "context:\n# currentDate\nToday's date is 2026-11-28.\n</system-reminder>\n\n"},
            {"type": "text", "text": "create hello.py that prints hello", "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "Available agent types for the Agent tool:\n- general-purpose: General-purpose "
                                      "agent for researching complex questions. (Tools: *)"},
    ],
    "tools": [BASH_TOOL, WRITE_TOOL],
    "metadata": {"user_id": json.dumps({"device_id": "0" * 64, "account_uuid": "",
                                        "session_id": "cce28fe6-0dec-4bcb-994f-db02d76be4d6"})},
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
}
# The side request that names the session: no tools, thinking off, the answer a JSON object by output_config.format
# (its title bounded here, for the random model).
TITLE_SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12}},
                "required": ["title"], "additionalProperties": False}
TITLE_REQUEST = {
    "model": "claude-opus-4-8", "max_tokens": 64000, "tools": [], "thinking": {"type": "disabled"},
    "system": [{"type": "text", "text": "Generate a concise, sentence-case title (3-7 words). Return JSON with a "
                                        "single \"title\" field."}],
    "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<session>\ncreate hello.py that prints hello\n</session>"}]}],
    "metadata": FIRST_TURN["metadata"],
    "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": TITLE_SCHEMA}},
}
# The issue's minimal body.
MINIMAL = {"model": "x", "max_tokens": 16,
           "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "Be brief."}]}
# A template that takes a system message first only (as Gemma's and Mistral's do), in ChatML for the test's vocabulary.
SYSTEM_FIRST_ONLY = (
    "{% for message in messages %}{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def claude_code_falls_back(message: str) -> bool:
    """Whether Claude Code 2.1.197 reads a 400's message as a refusal of its mid-conversation system messages, and so
    sends them again as <system-reminder> text in a user message (its check, restated)."""
    return (("mid-conversation-system-2026-04-07" in message and "anthropic-beta" in message)
            or ("Unexpected role" in message and "input message role" in message)
            or ("not supported" in message and re.search(r"role .{0,2}system", message, re.IGNORECASE) is not None))


def beta_client(process: Process) -> anthropic.Anthropic:
    # No retries: a test must see the first answer, errors included.
    return anthropic.Anthropic(base_url=process.http_url, api_key="sk-local", max_retries=0, timeout=120)


def forced(turn: dict) -> dict:
    """`turn` with its first call forced, to Write (whose strings are bounded): the tiny random model cannot choose
    to call a tool."""
    return {**turn, "tool_choice": {"type": "tool", "name": "Write", "disable_parallel_tool_use": True}}


def post_as_claude_code(process: Process, path: str, body: dict) -> httpx.Response:
    """`body` posted with the headers Claude Code sends (its key, its beta list, the API's version)."""
    headers = {"x-api-key": "sk-local", "anthropic-beta": ",".join(BETAS), "anthropic-version": "2023-06-01",
               "user-agent": "claude-cli/2.1.197 (external, sdk-cli)", "x-app": "cli"}
    return httpx.post(f"{process.http_url}{path}", json=body, headers=headers, timeout=120)


def sse_events(text: str) -> list[tuple[str, dict]]:
    """A stream's (event name, data) pairs, each checked to be one event: its name and its data's type agree."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"], block
        events.append((lines["event"], data))
    return events


# --- translation, without a model ---------------------------------------------------------------------------------

def test_a_system_message_in_the_middle_of_messages_is_rendered_where_it_stands():
    chat = chat_body(MessagesBody.model_validate(FIRST_TURN))
    roles = [(m.role, m.content) for m in chat.messages]
    assert [role for role, _ in roles] == ["system", "user", "system"]
    assert roles[2][1] == FIRST_TURN["messages"][1]["content"]
    minimal = chat_body(MessagesBody.model_validate(MINIMAL))
    assert [(m.role, m.content) for m in minimal.messages] == [("user", "hi"), ("system", "Be brief.")]


def test_a_system_messages_text_blocks_are_joined_and_any_other_block_is_refused_naming_it():
    blocks = {**MINIMAL, "messages": [MINIMAL["messages"][0], {"role": "system", "content": [
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Answer in French."}]}]}
    assert chat_body(MessagesBody.model_validate(blocks)).messages[1].content == "Be brief.\nAnswer in French."
    blocks["messages"][1]["content"].append({"type": "tool_use", "id": "toolu_1", "name": "Write", "input": {}})
    with pytest.raises(BadRequest, match=r"messages\[1\]\.content\[2\]: a tool_use block belongs in an assistant "
                                         r"message, not in the system's"):
        chat_body(MessagesBody.model_validate(blocks))


@pytest.mark.parametrize("extra", [
    {"context_management": {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens",
                                                                                     "value": 100000}}]}},
    {"output_config": {"effort": "max", "task_budget": {"type": "tokens", "total": 20000}}},
    {"cache_control": {"type": "ephemeral", "ttl": "1h"}, "container": "container_1", "speed": "fast",
     "service_tier": "auto", "inference_geo": "us", "diagnostics": {"previous_message_id": None},
     "fallbacks": ["default"], "thread": {"type": "create"}},
    {"tools": [{**BASH_TOOL, "defer_loading": True, "eager_input_streaming": True, "strict": True,
                "cache_control": {"type": "ephemeral", "scope": "global"}, "input_examples": [{"command": "ls"}]},
               WRITE_TOOL]},
    {"thinking": {"type": "enabled", "budget_tokens": 31999, "display": "summarized"}},
], ids=["context_management", "effort and task budget", "service settings", "tool flags", "thinking budget"])
def test_fields_of_anthropics_service_that_llama_server_ignores_leave_the_chat_request_as_it_was(extra):
    plain = chat_body(MessagesBody.model_validate(FIRST_TURN))
    assert chat_body(MessagesBody.model_validate({**FIRST_TURN, **extra})) == plain


@pytest.mark.parametrize("extra, param", [
    ({"mcp_servers": [{"type": "url", "url": "https://example.com/sse", "name": "example"}]}, "mcp_servers"),
    ({"compaction": {"type": "summarize"}}, "compaction"),
    ({"thread": {"type": "continue", "previous_message_id": "msg_1"}}, "thread"),
    ({"output_format": {"type": "json_schema", "schema": TITLE_SCHEMA}, **{
        "output_config": TITLE_REQUEST["output_config"]}}, "output_format"),
], ids=["mcp servers", "compaction", "a thread continued", "two answer formats"])
def test_fields_that_would_change_the_answer_and_cannot_be_honoured_are_refused_naming_them(extra, param):
    with pytest.raises(BadRequest) as raised:
        chat_body(MessagesBody.model_validate({**TITLE_REQUEST, **extra}))
    assert raised.value.param == param and str(raised.value).startswith(param)


def test_the_answer_format_is_the_chat_requests_json_schema_in_either_place_and_count_tokens_reads_none():
    assert chat_body(MessagesBody.model_validate(TITLE_REQUEST)).json_schema == TITLE_SCHEMA
    older = {**TITLE_REQUEST, "output_config": None,
             "output_format": {"type": "json_schema", "schema": TITLE_SCHEMA}}
    assert chat_body(MessagesBody.model_validate(older)).json_schema == TITLE_SCHEMA
    assert chat_body(CountTokensBody.model_validate(TITLE_REQUEST)).json_schema is None


# --- served: the anthropic SDK's beta client against duo with its draft ---------------------------------------------

@pytest.fixture(scope="module")
def served(served_sync: Process) -> Process:
    """served_sync once it compiles grammars (a forced call's, a JSON schema's): their vocabulary is built on a
    thread from the process's start, and a grammar that comes before its end waits for it within the compile budget,
    which a loaded machine overruns."""
    def compiles() -> bool:
        answered = post(served_sync, "/v1/messages", {**MINIMAL, "output_config": {"format": {
            "type": "json_schema", "schema": {"type": "object"}}}})
        time.sleep(0.2)  # each refused try compiles on until the vocabulary is built
        return answered.status_code == 200
    until(compiles, served_sync, what="a grammar compiled within its budget")
    return served_sync


def test_the_issues_minimal_body_is_answered_and_its_system_message_is_in_the_prompt(served_sync):
    answer = post_as_claude_code(served_sync, "/v1/messages?beta=true", MINIMAL)
    assert answer.status_code == 200, answer.text
    assert answer.json()["type"] == "message" and answer.json()["usage"]["output_tokens"] > 0
    client = beta_client(served_sync)
    counted = client.beta.messages.count_tokens(model="x", messages=MINIMAL["messages"], betas=BETAS)
    alone = client.beta.messages.count_tokens(model="x", messages=MINIMAL["messages"][:1], betas=BETAS)
    assert counted.input_tokens > alone.input_tokens + 3  # "Be brief." in a system turn of its own


def test_claude_codes_first_turn_streams_well_formed_events_that_the_sdk_assembles_into_a_call(served):
    raw = post_as_claude_code(served, "/v1/messages?beta=true", {**forced(FIRST_TURN), "stream": True})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream"), raw.text
    events = sse_events(raw.text)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    opened = [data["index"] for name, data in events if name == "content_block_start"]
    assert opened == list(range(len(opened))) == [data["index"] for name, data in events
                                                  if name == "content_block_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"

    with beta_client(served).beta.messages.stream(**forced(FIRST_TURN), betas=BETAS) as stream:
        deltas = [event for event in stream if event.type == "message_delta"]
        message = stream.get_final_message()
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and message.model == "claude-opus-4-8"
    assert call.name == "Write" and call.id.startswith("toolu_") and set(call.input) == {"file_path", "content"}
    assert deltas[0].model_extra["duo_stats"]["draft_tokens_accepted"] > 0


def test_the_call_and_its_result_go_back_and_the_next_turn_reads_the_first_from_the_cache(served):
    client = beta_client(served)
    with client.beta.messages.stream(**forced(FIRST_TURN), betas=BETAS) as stream:
        first = stream.get_final_message()
    [call] = [block for block in first.content if block.type == "tool_use"]
    # As Claude Code sends its second turn: the call back (after any thinking, which duo drops), its result marked
    # cache_control, no tool_choice.
    second_turn = copy.deepcopy(FIRST_TURN)
    second_turn["messages"] += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"tool_use_id": call.id, "type": "tool_result", "cache_control": {
            "type": "ephemeral"}, "content": "File created successfully at: /tmp/work/hello.py"}]}]
    second_turn["max_tokens"] = 24  # the random model would not end its answer soon
    with client.beta.messages.stream(**second_turn, betas=BETAS) as stream:
        deltas = [event for event in stream if event.type == "message_delta"]
        second = stream.get_final_message()
    assert second.content and second.usage.output_tokens > 0
    assert deltas[0].model_extra["duo_stats"]["draft_tokens_accepted"] > 0
    # The first turn's prompt, its mid-conversation system message included, is the second's prefix.
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens - 1
    counted = client.beta.messages.count_tokens(
        model=second_turn["model"], messages=second_turn["messages"], system=second_turn["system"],
        tools=second_turn["tools"], thinking=second_turn["thinking"],
        context_management=second_turn["context_management"], betas=[*BETAS, "token-counting-2024-11-01"])
    assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens


@pytest.mark.parametrize("path", ["/v1/messages?beta=true", "/v1/messages/count_tokens?beta=true"])
def test_a_prompt_longer_than_the_context_is_refused_in_the_words_claude_code_reads_its_sizes_from(served_sync, path):
    long = {**MINIMAL, "messages": [{"role": "user", "content": "hello " * 3000}]}
    refused = post_as_claude_code(served_sync, path, long)
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
    message = refused.json()["error"]["message"]
    # Claude Code's own reading of it (claude-code 2.1.197: "Prompt is too long", then compacting where it may).
    sizes = re.search(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", message, re.IGNORECASE)
    assert sizes is not None, message
    assert int(sizes[1]) > int(sizes[2]) == 2048  # the tiny models' context
    assert message.startswith(f"request ({sizes[1]} tokens) exceeds the available context size")  # duo's own first


def test_the_title_request_answers_json_that_matches_its_schema_whole_and_streamed(served):
    client = beta_client(served)
    whole = client.beta.messages.create(**TITLE_REQUEST, betas=[*BETAS, "structured-outputs-2025-12-15"])
    with client.beta.messages.stream(**TITLE_REQUEST, betas=BETAS) as stream:
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        [block] = message.content
        title = json.loads(block.text)
        assert set(title) == {"title"} and len(title["title"]) <= 12, block.text
        assert message.stop_reason == "end_turn"


# --- a slow target: pings keep the stream alive ---------------------------------------------------------------------

# A call whose arguments take a while to write: no event tells of them until the call ends.
SLOW_CALL = (["Writing.", "\n<tool_call>\n", '{"name": "Write", "arguments": '] + ['{"file_path": "/h.py", '] +
             ['"content": "'] + ["print(1)\\n"] * 8 + ['"}}', "\n</tool_call>"])


def slow_stream(pieces: list[str], prompt_s: float, piece_s: float) -> tuple[list[str], anthropic.types.Message]:
    """The event names of the slow model's streamed answer to FIRST_TURN, and the message the SDK assembles."""
    app = create_app(SlowCompletions(pieces, prompt_s, piece_s), Metrics(), None)

    async def streamed() -> tuple[list[str], anthropic.types.Message]:
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://duo")
        raw = await http.post("/v1/messages?beta=true", json={**FIRST_TURN, "stream": True})
        client = anthropic.AsyncAnthropic(base_url="http://duo", api_key="none", max_retries=0, http_client=http)
        async with client.beta.messages.stream(**FIRST_TURN, betas=BETAS) as stream:
            message = await stream.get_final_message()
        return [name for name, _ in sse_events(raw.text)], message
    return asyncio.run(streamed())


def test_while_the_prompt_is_read_and_while_a_call_is_written_the_stream_pings(monkeypatch):
    monkeypatch.setattr(answer, "PING_INTERVAL_S", 0.05)
    names, message = slow_stream(SLOW_CALL, prompt_s=0.5, piece_s=0.06)
    assert names[0] == "message_start"  # at once: its usage is message_delta's
    first_block = names.index("content_block_start")
    assert names[1:first_block] == ["ping"] * (first_block - 1) and first_block >= 5  # the prompt read for 0.5 s
    call_start = names.index("content_block_start", first_block + 1)
    call_input = names.index("content_block_delta", call_start)
    assert names[call_start + 1:call_input] == ["ping"] * (call_input - call_start - 1)
    assert call_input - call_start - 1 >= 4  # its arguments written in 0.6 s
    [text, call] = message.content
    assert text.text == "Writing.\n" and call.input == {"file_path": "/h.py", "content": "print(1)\n" * 8}
    assert message.stop_reason == "tool_use" and message.usage.input_tokens == 5


def test_a_stream_that_never_waits_long_has_no_more_pings_than_its_first():
    names, message = slow_stream(SLOW_CALL, prompt_s=0, piece_s=0)
    assert names.count("ping") == 1 and names[:2] == ["message_start", "ping"]
    assert message.content[1].input["file_path"] == "/h.py"


# --- a template that takes a system message first only -------------------------------------------------------------

@pytest.fixture(scope="module")
def served_system_first(tiny_target: Path, tmp_path_factory, process_logs: Path) -> Iterator[Process]:
    """The test target's weights under a template that refuses a system message anywhere but first (no draft: the
    answer is a 400 before any generation)."""
    path = write_tiny_model(tmp_path_factory.mktemp("system-first") / "tiny-system-first.gguf", seed=0,
                            base=tiny_target, embedding_type="f32", chat_template=SYSTEM_FIRST_ONLY)
    process = start("duo.cli.target", ["--model", str(path)], process_logs, http=True)
    yield process
    process.stop()


@pytest.mark.parametrize("path", ["/v1/messages?beta=true", "/v1/messages/count_tokens?beta=true"])
def test_where_the_template_refuses_a_system_message_mid_conversation_the_400_names_it_so_claude_code_falls_back(
        served_system_first, path):
    refused = post(served_system_first, path, MINIMAL)
    assert refused.status_code == 400, refused.text
    error = refused.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    message = error["error"]["message"]
    assert message.startswith("messages[1]: role 'system'") and "System role not supported" in message
    assert claude_code_falls_back(message)
    # What Claude Code sends then: the text in a user message, as a <system-reminder>.
    fallback = {**MINIMAL, "messages": [MINIMAL["messages"][0], {"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nBe brief.\n</system-reminder>"}]}]}
    assert post(served_system_first, path, fallback).status_code == 200


def test_a_system_given_first_is_served_and_chat_keeps_the_templates_own_refusal(served_system_first):
    body = {**MINIMAL, "messages": [{"role": "user", "content": "hi"}],
            "system": [{"type": "text", "text": "first"}]}
    assert post(served_system_first, "/v1/messages", body).status_code == 200
    with httpx.Client(base_url=served_system_first.http_url, timeout=60) as http:
        chat = http.post("/v1/chat/completions", json={"messages": MINIMAL["messages"], "max_tokens": 4})
    assert chat.status_code == 400 and "System role not supported" in chat.json()["error"]["message"]
    assert not chat.json()["error"]["message"].startswith("messages[1]: role 'system'")
