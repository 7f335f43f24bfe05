"""What a request says of tools (OpenAI's `tools` and `tool_choice`), and its messages as chat templates take them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from pydantic import BaseModel, PrivateAttr

from duo.api.serving.limits import MAX_JSON_DEPTH, nesting_depth
from duo.api.tools.lark_json import InputGrammar

# llama.cpp's words for a template with no tool syntax (common/chat.cpp's generic handler, and minja's polyfill that
# describes the tools in the system message).
GENERIC_TOOLS = "You can call any of the following tools to satisfy the user's requests: "
GENERIC_ANSWER = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` reply "
                  "to the user's request")


class ToolError(ValueError):
    """A request whose tools cannot be served as asked; `param` names the field to fix."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class FunctionBody(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # either way a required call matches its parameters' schema
    # A Responses custom tool's input grammar, set by duo (never by a body): a required call writes its one string
    # argument under it.
    _input_grammar: InputGrammar | None = PrivateAttr(default=None)

    @property
    def input_grammar(self) -> InputGrammar | None:
        return self._input_grammar

    def constrain_input(self, grammar: InputGrammar) -> None:
        self._input_grammar = grammar


class ToolBody(BaseModel):
    type: Literal["function"]
    function: FunctionBody


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON, as OpenAI sends it

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asks of tools: `offered` as the template renders them, the functions the model may
    call, whether it must call one (`required` or a named function), and whether it may call several."""

    offered: list[dict[str, Any]]
    callable: list[FunctionBody]
    required: bool
    parallel: bool


def tool_use(tools: Sequence[ToolBody] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolUse | None:
    """The request's ToolUse, None without tools (or with tool_choice none: the template then renders none, as
    the model may call none); ToolError for a choice that tools cannot meet."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice requires tools: send the functions the model may call", "tool_choice")
        return None
    functions = called_functions(tools, choice)
    if not functions:
        return None
    return ToolUse(offered=[tool.model_dump(exclude_none=True) for tool in tools], callable=functions,
                   required=choice not in (None, "auto"), parallel=parallel is not False)


def called_functions(tools: Sequence[ToolBody], choice: ToolChoice | None) -> list[FunctionBody]:
    """The functions the model may call: none for `none`, one for a named choice (ToolError if not offered)."""
    if choice == "none":
        return []
    if isinstance(choice, NamedToolChoice):
        named = [tool.function for tool in tools if tool.function.name == choice.function.name]
        if not named:
            raise ToolError(f"tool_choice names function {choice.function.name!r}, which tools does not offer",
                            "tool_choice")
        return named
    return [tool.function for tool in tools]


def template_message(role: str, content: str, tool_calls: Sequence[dict[str, Any]] | None,
                     tool_call_id: str | None, reasoning: str | None = None) -> dict[str, Any]:
    """A message as chat templates take it: a call's arguments as an object (templates write them with tojson;
    a JSON string there would be written quoted), the tool result's call id beside it, an answer's reasoning as
    reasoning_content (the templates that reason render it where they keep it, as llama-server passes it)."""
    message: dict[str, Any] = {"role": role, "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = [{**call, "function": {**call["function"],
                                                       "arguments": _as_object(call["function"]["arguments"])}}
                                 for call in tool_calls]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    return message


def _as_object(arguments: str) -> Any:
    """The arguments as JSON where they are (as sent where not); ToolError where they nest deeper than the template's
    tojson can write (it recurses once per level)."""
    try:
        value = json.loads(arguments)
        too_deep = nesting_depth(value) > MAX_JSON_DEPTH
    except ValueError:
        return arguments
    except RecursionError:  # deeper than the parser follows, so deeper than the bound too
        too_deep = True
    if too_deep:
        raise ToolError(f"a tool call's arguments nest more than {MAX_JSON_DEPTH} levels deep", param="messages")
    return value


def with_tools_described(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` for a template with no tool syntax (the generic format): the tools and the JSON answer described in
    the system message (appended to the client's own, as llama.cpp's add_system does)."""
    described = f"{GENERIC_TOOLS}{json.dumps(list(tools), indent=2, ensure_ascii=False)}\n\n{GENERIC_ANSWER}"
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{described}"}, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]
