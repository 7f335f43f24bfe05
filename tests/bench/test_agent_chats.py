"""The agents' chats the bench renders (duo/bench/agent_prompts/NAME.chat.json) are what duo's API makes of the
captured bodies today (scripts/agent_chats.py writes them through the API's own translation): the bench measures the
prompt duo serves to each agent, and the two cannot drift apart."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from duo.bench.agents import AGENT_PROMPTS, AGENTS, read_agent_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import agent_chats  # noqa: E402


def captured(agent: str) -> dict:
    return json.loads((AGENT_PROMPTS / f"{agent}.json").read_text())


@pytest.mark.parametrize("agent", AGENTS)
def test_each_stored_chat_is_what_duos_api_makes_of_the_captured_body_today(agent):
    stored = json.loads(agent_chats.chat_path(agent).read_text())
    assert stored == agent_chats.template_chat(captured(agent)), \
        f"{agent}.chat.json is stale: run `python scripts/agent_chats.py` after changing the API's translation"


def test_the_bench_reads_the_stored_chats_as_they_are():
    for prompt in read_agent_prompts():
        stored = json.loads(agent_chats.chat_path(prompt.agent).read_text())
        assert (prompt.messages, prompt.tools, prompt.variables) == (stored["messages"], stored["tools"],
                                                                     stored["variables"])


def test_codex_namespace_functions_reach_the_template_under_the_names_duo_parses_back():
    codex = read_agent_prompts()[0]
    names = [tool["function"]["name"] for tool in codex.tools]
    namespaces = [tool for tool in captured("codex")["tools"] if tool["type"] == "namespace"]
    assert namespaces, "Codex's default body offers a namespace of functions (multi_agent_v1)"
    for namespace in namespaces:
        for member in namespace["tools"]:
            assert f"{namespace['name']}.{member['name']}" in names and member["name"] not in names


def test_claude_codes_mid_conversation_system_message_stays_where_it_stands():
    body = captured("claude_code")
    claude_code = read_agent_prompts()[1]
    assert [message["role"] for message in body["messages"]][-1] == "system"
    assert [message["role"] for message in claude_code.messages] == ["system", "user", "system"]


def test_claude_codes_thinking_reaches_the_template_as_enable_thinking():
    assert captured("claude_code")["thinking"]["type"] != "disabled"
    assert read_agent_prompts()[1].variables == {"enable_thinking": True}


def test_the_script_writes_one_chat_beside_each_captured_body(tmp_path):
    for agent in AGENTS:
        (tmp_path / f"{agent}.json").write_text(json.dumps(captured(agent)))
    written = agent_chats.write_chats(tmp_path)
    assert [path.name for path in written] == [f"{agent}.chat.json" for agent in AGENTS]
    assert read_agent_prompts(tmp_path) == read_agent_prompts()
