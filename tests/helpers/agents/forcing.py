"""The proxy's rewrite of an agent's model calls, because the tiny random models can neither choose a tool nor end
an answer: the first call that offers one of the agent's harmless tools is forced to it, and every other call is
held to a one-word answer.

Forced, the call's arguments are sampled from the tool's schema, narrowed to its required properties with short
strings of letters (a random model never closes a string). Every other answer must match the JSON schema of the
string "Done." (the answer format each protocol offers), so that it ends by itself with text, as a finished turn
does: cut by max_tokens instead, each client asks again to continue, for minutes. max_tokens is clamped too, as a
bound: the clients ask for up to 64k tokens."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from duo.bench.live.clients import Agent

MAX_TOKENS = 256
ANSWER = {"type": "string", "enum": ["Done."]}
SHORT_STRING = 12  # characters of a forced call's string argument
SHORT_PATTERN = "^[a-z]+$"


def tool_names(path: str, body: dict) -> list[str]:
    """The names of the function tools a model call offers, namespaced ones (the Responses API's) included."""
    return [name for tool in tools_of(path, body) if (name := tool.get("name"))]


def tools_of(path: str, body: dict) -> list[dict]:
    """The function definitions a model call offers ({name, parameters or input_schema, ...}), nested ones too."""
    found = []
    for tool in body.get("tools") or []:
        if path.endswith("/chat/completions"):
            found.append(tool.get("function") or {})
        else:
            found.append(tool)
            found.extend(tool.get("tools") or [])
    return found


def narrowed(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with its required properties alone, each string among them short."""
    required = schema.get("required") or []
    properties = {name: schema["properties"][name] for name in required}
    for name, spec in properties.items():
        if spec.get("type") == "string" and "enum" not in spec:
            # Letters only: a path the model makes up is then a relative one, inside the agent's folder (a random
            # "/" read by opencode asked for a permission outside it, which its run refuses, ending the run).
            properties[name] = {**spec, "maxLength": SHORT_STRING, "pattern": SHORT_PATTERN}
    return {**schema, "properties": properties, "additionalProperties": False}


def narrow(path: str, body: dict, name: str) -> None:
    """Narrow the arguments of the tool `name` wherever `body` offers it."""
    for tool in tools_of(path, body):
        if tool.get("name") == name:
            key = "input_schema" if path.endswith("/messages") else "parameters"
            tool[key] = narrowed(tool.get(key) or {"type": "object"})


def force(path: str, body: dict, name: str) -> None:
    """Make `body` call the tool `name`."""
    if path.endswith("/responses"):
        body["tool_choice"] = {"type": "function", "name": name}
    elif path.endswith("/messages"):
        body["tool_choice"] = {"type": "tool", "name": name}
    else:
        body["tool_choice"] = {"type": "function", "function": {"name": name}}


def answer_briefly(path: str, body: dict) -> None:
    """Hold the answer to ANSWER, unless the client asked for a format of its own (Claude Code's session title)."""
    if path.endswith("/responses") and not (body.get("text") or {}).get("format"):
        body["text"] = {**(body.get("text") or {}),
                        "format": {"type": "json_schema", "name": "done", "schema": ANSWER}}
    elif path.endswith("/messages") and not (body.get("output_config") or {}).get("format"):
        body["output_config"] = {**(body.get("output_config") or {}),
                                 "format": {"type": "json_schema", "schema": ANSWER}}
    elif path.endswith("/chat/completions") and not body.get("response_format"):
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "done", "schema": ANSWER}}


def clamp(path: str, body: dict) -> None:
    if path.endswith("/responses"):
        field = "max_output_tokens"
    elif path.endswith("/messages"):
        field = "max_tokens"
    else:
        field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    body[field] = min(body.get(field) or MAX_TOKENS, MAX_TOKENS)


@dataclass
class FirstCallForcer:
    """The rewrite for one agent's run; `forced` is the tool its first call was forced to, once it was."""

    agent: Agent
    forced: str | None = None
    forced_index: int = -1  # the index of the forced exchange in the proxy's record

    def __call__(self, exchanges: list, path: str, body: dict) -> dict:
        if path != self.agent.model_path:
            return body
        body = copy.deepcopy(body)
        clamp(path, body)
        name = next((n for n in self.agent.harmless_tools if n in tool_names(path, body)), None)
        if name is not None:
            # Narrowed in every call, not only the forced one: the tools are rendered at the prompt's start, and
            # a prompt that changed there would be read again whole (seconds, on 15k-token prompts).
            narrow(path, body, name)
        if self.forced is None and name is not None:
            force(path, body, name)
            self.forced, self.forced_index = name, len(exchanges)
        else:
            answer_briefly(path, body)
        return body
