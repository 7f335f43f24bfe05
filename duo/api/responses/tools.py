"""The Responses API's tools as the chat tools a template renders, and the model's calls of them back in their own
shape: functions as they are, a namespace's functions under one flat name each, custom (freeform) tools as a function
of one string."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from duo.api.serving.request import BadRequest
from duo.api.responses.body import Tool

# What a custom tool's call takes, as the one string argument of the function it is offered as.
CUSTOM_ARGUMENT = "input"


@dataclass(frozen=True)
class Origin:
    """Where a chat function came from: a function or custom tool, on its own (namespace None) or in a namespace."""

    name: str
    namespace: str | None = None
    custom: bool = False


def flat_name(namespace: str | None, name: str) -> str:
    """A namespace's function as one chat function name, as llama-server names it: every '.' of each part doubled,
    the parts joined by one '.' (multi_agent_v1, spawn_agent -> multi_agent_v1.spawn_agent), so the name reads back
    whole; no namespace leaves the name as it is."""
    if not namespace:
        return name
    return f"{namespace.replace('.', '..')}.{name.replace('.', '..')}"


class ResponsesTools:
    """The request's tools: `chat` the chat tools offered to the template (tools OpenAI's servers run left out, as
    llama-server leaves them out), and what each chat function's call is in the Responses shape."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.chat: list[dict[str, Any]] = []
        self.origins: dict[str, Origin] = {}
        for tool in tools:
            if tool.type == "function":
                self._offer(tool, Origin(tool.name or ""))
            elif tool.type == "namespace":
                for member in tool.tools or []:
                    self._offer(member, Origin(member.name or "", tool.name, custom=member.type == "custom"))
            elif tool.type == "custom":
                self._offer(tool, Origin(tool.name or "", custom=True))

    def _offer(self, tool: Tool, origin: Origin) -> None:
        name = flat_name(origin.namespace, origin.name)
        if name in self.origins:
            raise BadRequest(f"two tools are named {name!r}: a chat template tells the model's calls apart by name "
                             "alone", param="tools")
        self.origins[name] = origin
        function = custom_function(tool) if origin.custom else tool.model_dump(exclude_none=True,
                                                                               exclude={"type", "tools", "format"})
        self.chat.append({"type": "function", "function": {**function, "name": name}})

    def item(self, call_id: str, name: str) -> dict[str, Any]:
        """The model's call of chat function `name` as a Responses output item, before its arguments or input are
        known."""
        origin = self.origins.get(name, Origin(name))
        item: dict[str, Any] = {"type": "custom_tool_call", "call_id": call_id, "name": origin.name, "input": ""} \
            if origin.custom else {"type": "function_call", "call_id": call_id, "name": origin.name, "arguments": ""}
        if origin.namespace is not None:
            item["namespace"] = origin.namespace  # Codex finds a namespaced tool by both (its ResponseItem)
        return item


def custom_function(tool: Tool) -> dict[str, Any]:
    """A custom tool as a function of one string. A regex format becomes the string's pattern, which a constrained
    call (tool_choice required or naming the tool) matches whole; a Lark grammar has no JSON schema form (the input
    sits inside a JSON string), so it is told in the description and not masked: llama-server offers no custom tools
    at all, and the tool's owner checks its input as it does any model's."""
    format_ = tool.format or {}
    grammar = format_.get("definition") if format_.get("type") == "grammar" else None
    text: dict[str, Any] = {"type": "string"}
    description = tool.description or ""
    if grammar and format_.get("syntax") == "regex":
        text["pattern"] = f"^(?:{grammar})$"
    elif grammar:
        description += f"\n\nThe `{CUSTOM_ARGUMENT}` must match this {format_.get('syntax')} grammar:\n{grammar}"
    return {"name": tool.name, "description": description.strip(),
            "parameters": {"type": "object", "properties": {CUSTOM_ARGUMENT: text}, "required": [CUSTOM_ARGUMENT],
                           "additionalProperties": False}}


def custom_input(arguments: str) -> str:
    """A custom tool's input out of the arguments of the function it was offered as (the whole arguments where the
    model wrote no such string)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    text = value.get(CUSTOM_ARGUMENT) if isinstance(value, dict) else None
    return text if isinstance(text, str) else arguments


def chat_call(item: dict[str, Any]) -> dict[str, Any]:
    """A function_call or custom_tool_call item (one the model made earlier, sent back) as the chat call the model
    wrote: a namespace's function under its flat name, a custom tool's input as the function's one argument."""
    if item["type"] == "custom_tool_call":
        arguments = json.dumps({CUSTOM_ARGUMENT: item.get("input") or ""}, ensure_ascii=False)
    else:
        arguments = item.get("arguments") or "{}"
    return {"id": item["call_id"], "type": "function",
            "function": {"name": flat_name(item.get("namespace"), item["name"]), "arguments": arguments}}
