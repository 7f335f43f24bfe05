"""Writes, beside each captured agent body in duo/bench/agent_prompts/, the chat duo's API makes of it (NAME.chat.json).

`duo bench --prompts agent` renders these chats with the target's template and sends the same text to duo and to
llama-server; the bench may not import duo.api (tests/house/test_layout.py), so the translation is done here, by
the API's own functions, and stored: {"messages": [...], "tools": [...], "variables": {...}}, exactly what the route
hands the chat template (OpenAI's chat shape; an earlier call's arguments as an object, as templates take them; the
template variables the body sets, as Claude Code's thinking sets enable_thinking). Each body goes
through its protocol's route: Codex's Responses body through duo.api.responses, Claude Code's Messages body through
duo.api.anthropic, Qwen Code's and opencode's chat bodies as /v1/chat/completions reads them.
tests/bench/test_agent_chats.py checks that the stored chats are what this makes of the bodies today. Run it after a
change of the translation:

    python scripts/agent_chats.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from duo.api.anthropic import translate as messages_api
from duo.api.anthropic.body import MessagesBody
from duo.api.openai.bodies import ChatBody
from duo.api.responses import translate as responses_api
from duo.api.responses.body import ResponsesBody
from duo.api.responses.tools import ResponsesTools
from duo.bench.agents import AGENT_PROMPTS, AGENTS

Body = dict[str, Any]


def chat_of(body: Body) -> ChatBody:
    """The chat request duo serves for a captured body, by its protocol's shape: Responses (input), Messages (a
    top-level system, or tools with an input_schema), else chat completions."""
    if "input" in body:
        responses = ResponsesBody.model_validate(body)
        responses.check_supported()
        tools = ResponsesTools(responses.tools or [])
        return responses_api.chat_body(responses, responses_api.input_messages(responses), tools)
    if "system" in body or any("input_schema" in tool for tool in body.get("tools", [])):
        return messages_api.chat_body(MessagesBody.model_validate(body))
    return ChatBody.model_validate(body)


def template_chat(body: Body) -> Body:
    """The messages, tools and variables duo's chat template is given for `body` (duo.api.serving.prepare renders
    them)."""
    request = chat_of(body).to_request()
    return {"messages": list(request.messages), "tools": request.tool_use.offered if request.tool_use else [],
            "variables": dict(request.chat_template_kwargs or {})}


def chat_path(agent: str, folder: Path = AGENT_PROMPTS) -> Path:
    return folder / f"{agent}.chat.json"


def write_chats(folder: Path = AGENT_PROMPTS) -> list[Path]:
    """Each agent's chat file written from its captured body; the paths written."""
    written = []
    for agent in AGENTS:
        chat = template_chat(json.loads((folder / f"{agent}.json").read_text()))
        path = chat_path(agent, folder)
        path.write_text(json.dumps(chat, indent=1, ensure_ascii=False) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    for written in write_chats():
        print(written)
