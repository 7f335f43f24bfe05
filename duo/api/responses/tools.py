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
from duo.api.tools import ToolBody
from duo.api.tools.lark_json import InputGrammar, Unsupported, escaped_lark

# What a custom tool's call takes, as the one string argument of the function it is offered as.
CUSTOM_ARGUMENT = "input"
# The Lark grammars of one request's custom tools, in characters together: reading them is pure Python on a loaded
# core (Codex's apply_patch, 626 characters: ~25 ms; 68k characters of rules: 2 s).
MAX_LARK_CHARS = 32_768


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
        self.input_grammars: dict[str, InputGrammar] = {}  # by chat name: custom tools whose input follows Lark
        for i, tool in enumerate(tools):
            if tool.type == "function":
                self._offer(tool, Origin(tool.name or ""), f"tools[{i}]")
            elif tool.type == "namespace":
                for j, member in enumerate(tool.tools or []):
                    self._offer(member, Origin(member.name or "", tool.name, custom=member.type == "custom"),
                                f"tools[{i}].tools[{j}]")
            elif tool.type == "custom":
                self._offer(tool, Origin(tool.name or "", custom=True), f"tools[{i}]")

    def _offer(self, tool: Tool, origin: Origin, where: str) -> None:
        name = flat_name(origin.namespace, origin.name)
        if name in self.origins:
            raise BadRequest(f"two tools are named {name!r}: a chat template tells the model's calls apart by name "
                             "alone", param="tools")
        self.origins[name] = origin
        if origin.custom and (grammar := lark_input(tool, f"{where}.format", self._lark_chars_left())):
            self.input_grammars[name] = grammar
        function = custom_function(tool) if origin.custom else tool.model_dump(exclude_none=True,
                                                                               exclude={"type", "tools", "format"})
        self.chat.append({"type": "function", "function": {**function, "name": name}})

    def _lark_chars_left(self) -> int:
        return MAX_LARK_CHARS - sum(grammar.source_chars for grammar in self.input_grammars.values())

    def constrain(self, tools: Sequence[ToolBody]) -> None:
        """Give the chat functions of custom tools whose input follows a Lark grammar that grammar, which a required
        call's grammar writes their input under (duo.api.tools.grammars)."""
        for tool in tools:
            if tool.function.name in self.input_grammars:
                tool.function.constrain_input(self.input_grammars[tool.function.name])

    def item(self, call_id: str, name: str) -> dict[str, Any]:
        """The model's call of chat function `name` as a Responses output item, before its arguments or input are
        known."""
        origin = self.origins.get(name, Origin(name))
        item: dict[str, Any] = {"type": "custom_tool_call", "call_id": call_id, "name": origin.name, "input": ""} \
            if origin.custom else {"type": "function_call", "call_id": call_id, "name": origin.name, "arguments": ""}
        if origin.namespace is not None:
            item["namespace"] = origin.namespace  # Codex finds a namespaced tool by both (its ResponseItem)
        return item


def lark_input(tool: Tool, param: str, most_chars: int) -> InputGrammar | None:
    """A custom tool's Lark format as the grammar its input is written under, JSON-escaped inside its call
    (duo.api.tools.lark_json); None for other formats; BadRequest naming `param` for a grammar duo cannot enforce
    exactly, or one longer than `most_chars`."""
    format_ = tool.format or {}
    if format_.get("type") != "grammar" or format_.get("syntax") != "lark":
        return None
    definition = format_.get("definition") or ""
    if len(definition) > most_chars:
        raise BadRequest(f"{param}: the request's Lark grammars may hold {MAX_LARK_CHARS} characters together; "
                         f"this one has {len(definition)} of the {max(most_chars, 0)} left", param=param)
    try:
        return InputGrammar(CUSTOM_ARGUMENT, escaped_lark(definition), param, len(definition))
    except Unsupported as error:
        raise BadRequest(f"{param}: {error}", param=param) from None


def custom_function(tool: Tool) -> dict[str, Any]:
    """A custom tool as a function of one string. Where a call is constrained (tool_choice required or naming the
    tool) its input matches the format whole: a regex as the string's pattern, a Lark grammar written out in the
    call's grammar (ResponsesTools.constrain). Both are told the model: a pattern by the schema, a Lark grammar in the
    description; under tool_choice auto neither is masked, as no function's parameters are."""
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
        return _cut_input(arguments)
    text = value.get(CUSTOM_ARGUMENT) if isinstance(value, dict) else None
    return text if isinstance(text, str) else arguments


def _cut_input(arguments: str) -> str:
    """The input written so far of a call cut short (by the token limit) inside its string, where the arguments open
    as a constrained call writes them; else the arguments as they are."""
    opening = "{" + json.dumps(CUSTOM_ARGUMENT) + ': "'
    if not arguments.startswith(opening):
        return arguments
    written = arguments[len(opening):]
    for end in range(len(written), max(len(written) - len("\\u0000"), -1), -1):  # an escape cut short is left out
        try:
            return json.loads(f'"{written[:end]}"')
        except ValueError:
            continue
    return arguments


def chat_call(item: dict[str, Any]) -> dict[str, Any]:
    """A function_call or custom_tool_call item (one the model made earlier, sent back) as the chat call the model
    wrote: a namespace's function under its flat name, a custom tool's input as the function's one argument."""
    if item["type"] == "custom_tool_call":
        arguments = json.dumps({CUSTOM_ARGUMENT: item.get("input") or ""}, ensure_ascii=False)
    else:
        arguments = item.get("arguments") or "{}"
    return {"id": item["call_id"], "type": "function",
            "function": {"name": flat_name(item.get("namespace"), item["name"]), "arguments": arguments}}
