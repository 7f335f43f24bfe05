"""Tool calls: OpenAI's `tools` rendered by the model's own chat template, the calls parsed out of what the model
writes, and a grammar that makes a call where the client requires one.

The call format is the model's: Qwen2.5 and Hermes-style templates (the ones that mention `<tool_call>`) ask for

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and that is what is parsed; a template that takes tools in another format (Llama 3.x, Mistral) is refused with a
400 rather than answered with calls nobody parses. Text that is not a well-formed call of a tool the request
offered stays content, as llama-server leaves it (Qwen2.5-Coder-1.5B, given a tool and `tool_choice: auto`,
often answers with a ```json block instead of its template's tags: that is content; `tool_choice: required` or
a named function makes the grammar write the template's own format, so the call always parses).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from pydantic import BaseModel

from duo.constraint import JSON_OPTIONS


OPEN, CLOSE = "<tool_call>", "</tool_call>"


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


def check_template_takes_tools(template: str) -> None:
    """BadRequest unless the chat template renders tools in the one call format duo parses."""
    if "tools" not in template:
        raise ToolError("this model's chat template does not take tools; send the request without them", "tools")
    if OPEN not in template:
        raise ToolError(f"this model's chat template writes tool calls in a format duo does not parse yet (it "
                        f"parses {OPEN}...{CLOSE}, Qwen2.5's and Hermes'); send the request without tools", "tools")


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
    """The functions the model may call: none for `none`, one for a named choice (BadRequest if not offered)."""
    if choice == "none":
        return []
    if isinstance(choice, NamedToolChoice):
        named = [tool.function for tool in tools if tool.function.name == choice.function.name]
        if not named:
            raise ToolError(f"tool_choice names function {choice.function.name!r}, which tools does not offer",
                            "tool_choice")
        return named
    return [tool.function for tool in tools]


def call_grammar(functions: Sequence[FunctionBody], parallel: bool, open_is_token: bool) -> str:
    """A grammar whose every answer is one call (several with `parallel`) of one of `functions`, its arguments
    matching the function's parameters (a Lark grammar): for tool_choice `required` or a named function. `open_is_token`: the
    model's vocabulary has <tool_call> and </tool_call> as tokens of their own (Qwen2.5), which the grammar
    then names as tokens, the way the model writes them."""
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name},
                                                           "arguments": f.parameters or {"type": "object"}},
                         "required": ["name", "arguments"], "additionalProperties": False} for f in functions],
              "x-guidance": JSON_OPTIONS}
    open_, close = (OPEN, CLOSE) if open_is_token else (json.dumps(OPEN), json.dumps(CLOSE))
    lark = (f'start: call{"+" if parallel else ""}\n'
            f'call: {open_} "\\n" %json {json.dumps(schema)} "\\n" {close} "\\n"?\n')
    return lark


class CallParser:
    """Splits the model's text, as it streams, into content and the calls of offered functions."""

    def __init__(self, functions: Sequence[FunctionBody]) -> None:
        self.names = {function.name for function in functions}
        self.buffer = ""
        self.inside = False  # within <tool_call> ... </tool_call>
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the calls that `text` completes; a possible start of a call is held back."""
        self.buffer += text
        content, calls = "", []
        while True:
            if not self.inside:
                at = self.buffer.find(OPEN)
                if at < 0:
                    held = _partial_suffix(self.buffer, OPEN)
                    content += self._content(self.buffer[:len(self.buffer) - held], calls)
                    self.buffer = self.buffer[len(self.buffer) - held:]
                    break
                content += self._content(self.buffer[:at], calls)
                self.buffer, self.inside = self.buffer[at + len(OPEN):], True
            else:
                at = self.buffer.find(CLOSE)
                if at < 0:
                    break
                raw, self.buffer, self.inside = self.buffer[:at], self.buffer[at + len(CLOSE):], False
                call = self._parsed(raw)
                if call is None:
                    content += OPEN + raw + CLOSE
                else:
                    calls.append(call)
        self.calls += len(calls)
        return content, calls

    def finish(self) -> str:
        """What is left at the end: text held back, or an unfinished call, as content."""
        rest = (OPEN if self.inside else "") + self.buffer
        self.buffer, self.inside = "", False
        return self._content(rest, [])

    def _content(self, text: str, calls: list[ToolCall]) -> str:
        """`text` as content, but for the line breaks between and after calls (the template's layout)."""
        return "" if (self.calls or calls) and text.isspace() else text

    def _parsed(self, raw: str) -> ToolCall | None:
        try:
            call = json.loads(raw)
        except ValueError:
            return None
        if not (isinstance(call, dict) and call.get("name") in self.names):
            return None
        arguments = call.get("arguments", {})
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", call["name"],
                        arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may be the start of one)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def template_message(role: str, content: str, tool_calls: Sequence[dict[str, Any]] | None,
                     tool_call_id: str | None) -> dict[str, Any]:
    """A message as chat templates take it: a call's arguments as an object (templates write them with tojson;
    a JSON string there would be written quoted), the tool result's call id beside it."""
    message: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        message["tool_calls"] = [{**call, "function": {**call["function"],
                                                       "arguments": _as_object(call["function"]["arguments"])}}
                                 for call in tool_calls]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    return message


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
