"""`duo bench --live-agents`' record and table of one agent's run, from given exchanges: the requests and their
statuses, the tool calls the answers made, the drafts, the first token, and whether the task got done and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from duo.bench.live.clients import AGENTS
from duo.bench.live.outcome import Drafts, record, table, task_check
from duo.bench.live.proxy import TOKEN_EVENT, Exchange
from duo.bench.live.runs import AgentRun

CODEX = AGENTS[0]
SSE = {"content-type": "text/event-stream"}


def sse(*payloads: dict) -> bytes:
    return b"".join(f"event: {p['type']}\ndata: {json.dumps(p)}\n\n".encode() for p in payloads)


def responses_call(call_id: str, name: str) -> bytes:
    item = {"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}"}
    return sse({"type": "response.created", "sequence_number": 0},
               {"type": "response.function_call_arguments.delta", "sequence_number": 1, "delta": "{}"},
               {"type": "response.output_item.done", "sequence_number": 2, "item": item},
               {"type": "response.completed", "sequence_number": 3})


def exchange(path: str, status: int, answer: bytes, headers: dict[str, str], first_token: float | None,
             seconds: float) -> Exchange:
    return Exchange("POST", path, "", {}, b"{}", b"{}", status, headers, answer, True, 0.0, seconds, first_token)


def codex_run(output: str = "I wrote hello.py\n") -> AgentRun:
    exchanges = [
        exchange("/v1/responses", 200, responses_call("c1", "shell"), SSE, 41.5, 60.0),
        exchange("/v1/models", 404, b'{"error": "not found"}', {"content-type": "application/json"}, None, 0.1),
        exchange("/v1/responses", 200, responses_call("c2", "shell"), SSE, 3.0, 5.0),
        exchange("/v1/responses", 200, json.dumps({"output": [{"type": "function_call", "call_id": "c3",
                                                               "name": "apply_patch"}]}).encode(),
                 {"content-type": "application/json"}, 2.0, 2.0),
    ]
    return AgentRun(CODEX, 0, output, exchanges, [], 71.4)


def folder_with(tmp_path: Path, script: str | None) -> Path:
    if script is not None:
        (tmp_path / "hello.py").write_text(script)
    return tmp_path


def test_the_record_counts_statuses_model_calls_and_the_tools_called_whole_or_streamed(tmp_path):
    entry = record(codex_run(), Drafts(120, 45), folder_with(tmp_path, "print('hello')\n"))
    assert entry["statuses"] == {"200": 3, "404": 1}
    assert entry["model_calls"] == 3
    assert entry["tool_calls"] == ["shell", "shell", "apply_patch"]
    assert entry["drafts"] == {"verified": 120, "accepted": 45}
    assert entry["first_token_s"] == 41.5  # the first model call's, not a later one's
    assert entry["wall_s"] == 71.4
    assert [r["status"] for r in entry["requests"]] == [200, 404, 200, 200]
    assert entry["task"] == {"done": True, "why": "python3 hello.py printed 'hello'"}


@pytest.mark.parametrize(("script", "why"), [
    (None, "no hello.py in the folder"),
    ("print('bye')\n", "python3 hello.py printed 'bye\\n'"),
    ("raise SystemExit(3)\n", "python3 hello.py exited 3: "),
])
def test_the_task_is_not_done_unless_hello_py_prints_hello(tmp_path, script, why):
    assert task_check(folder_with(tmp_path, script)) == (False, why)


def test_the_table_has_a_row_per_agent_with_why_and_the_clients_last_line(tmp_path):
    entry = record(codex_run("thinking\nI could not write the file.\n\n"), Drafts(10, 4), folder_with(tmp_path, None))
    lines = table([entry]).splitlines()
    assert lines[0].split()[:3] == ["agent", "try", "requests"]
    cells = lines[1].split()
    assert cells[0] == "codex" and "200x3" in cells and "404x1" in cells and "4/10" in cells and "41.5s" in cells
    assert lines[1].rstrip().endswith("NOT done")
    assert lines[2].strip() == ("task: no hello.py in the folder; exit 0; last output: I could not write the file.")


def test_a_run_on_a_server_with_no_draft_records_no_drafts_and_the_table_says_so(tmp_path):
    """llama-server alone (--live-server llama-server): null drafts, not 0/0, which would read as a draft that failed."""
    entry = record(codex_run(), None, folder_with(tmp_path, None))
    assert entry["drafts"] is None
    row = table([entry]).splitlines()[1]
    assert "no draft" in row and "0/0" not in row


def test_drafts_between_two_scrapes_are_their_difference():
    assert Drafts(300, 120) - Drafts(100, 20) == Drafts(200, 100)


@pytest.mark.parametrize(("piece", "carries"), [
    (b'event: response.created\ndata: {"type":"response.created","response":{"output":[]}}', False),
    (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi"}', True),
    (b'event: message_start\ndata: {"type":"message_start","message":{"content":[]}}', False),
    (b'event: content_block_delta\ndata: {"type":"content_block_delta"}', True),
    (b'data: {"object":"chat.completion.chunk","choices":[{"delta":{"role":"assistant","content":null}}]}', False),
    (b'data: {"object":"chat.completion.chunk","choices":[{"delta":{"content":""}}]}', False),
    (b'data: {"object":"chat.completion.chunk","choices":[{"delta":{"content":"def"}}]}', True),
    (b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{\\""}}]}}]}', True),
])
def test_a_piece_of_a_stream_marks_the_first_token_only_where_it_carries_one(piece, carries):
    assert bool(TOKEN_EVENT.search(piece)) is carries
