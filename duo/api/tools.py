"""Tool calls: OpenAI's `tools` rendered by the model's own chat template, the calls parsed out of what the model
writes, and a grammar that makes a call where the client requires one.

The call format is the model's, told by its template (CallFormat): Qwen2.5's and Hermes'

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Mistral's `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`, and Llama 3.x's answer that is one JSON object
`{"name": ..., "parameters": {...}}` (after an optional <|python_tag|>). A template that takes tools in none of
these is refused with a 400 rather than answered with calls nobody parses. Text that is not a well-formed call
of a tool the request offered stays content, as llama-server leaves it (Qwen2.5-Coder-1.5B, given a tool and
`tool_choice: auto`, often answers with a ```json block instead of its template's tags: that is content;
`tool_choice: required` or a named function makes a grammar write the template's own format, so the call always
parses).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel

from duo.api.limits import MAX_JSON_DEPTH, nesting_depth
from duo.constraint import JSON_OPTIONS


PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open its call with it


@dataclass(frozen=True)
class CallFormat:
    """How a family of chat templates asks the model to write its calls."""

    name: str
    marker: str     # text in the template that says it asks for this format
    open: str       # what starts the model's calls
    close: str      # what ends one call; "": the calls run to the end of the answer
    arguments: str  # the key of a call's arguments
    listed: bool    # the calls are one JSON array after `open` (Mistral), not one object each
    at_start: bool  # the answer is the call or no call (Llama 3.x writes a bare JSON object)


HERMES = CallFormat("Qwen2.5 / Hermes", "<tool_call>", "<tool_call>", "</tool_call>", "arguments", False, False)
MISTRAL = CallFormat("Mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", "", "arguments", True, False)
LLAMA3 = CallFormat("Llama 3.x", '"parameters": dictionary of argument name', "{", "", "parameters", False, True)
FORMATS = (HERMES, MISTRAL, LLAMA3)


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


def call_format(template: str) -> CallFormat:
    """The call format the chat template asks for; ToolError when it takes no tools or asks for another one."""
    if "tools" not in template:
        raise ToolError("this model's chat template does not take tools; send the request without them", "tools")
    for format_ in FORMATS:
        if format_.marker in template:
            return format_
    raise ToolError("this model's chat template writes tool calls in a format duo does not parse (it parses "
                    f"{', '.join(f.name for f in FORMATS)}); send the request without tools", "tools")


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


def call_grammar(functions: Sequence[FunctionBody], parallel: bool, format_: CallFormat,
                 token_of: Callable[[str], int | None]) -> str:
    """A Lark grammar whose every answer is one call (several with `parallel`, where the format can say so) of one
    of `functions` in the model's format, its arguments matching the function's parameters: for tool_choice
    `required` or a named function. `token_of(text)`: the id of the model's token for a marker that is one token
    (<tool_call>, [TOOL_CALLS]), named in the grammar as the model writes it; else None (then it is text)."""
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name},
                                                        format_.arguments: f.parameters or {"type": "object"}},
                       "required": ["name", format_.arguments], "additionalProperties": False} for f in functions],
            "x-guidance": JSON_OPTIONS}

    def marker(text: str) -> str:
        token = token_of(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    if format_.listed:
        calls = {"type": "array", "items": call, "minItems": 1, "x-guidance": JSON_OPTIONS}
        if not parallel:
            calls["maxItems"] = 1
        return f'start: {marker(format_.open)} " "? %json {json.dumps(calls)}\n'
    if format_.at_start:
        return f"start: %json {json.dumps(call)}\n"
    return (f'start: call{"+" if parallel else ""}\n'
            f'call: {marker(format_.open)} "\\n" %json {json.dumps(call)} "\\n" {marker(format_.close)} "\\n"?\n')


class CallParser:
    """Splits the model's text, as it streams, into content and the calls of offered functions, in the model's
    call format. Where a call may be starting, text is held back until it is clear."""

    def __init__(self, functions: Sequence[FunctionBody], format_: CallFormat = HERMES) -> None:
        self.names = {function.name for function in functions}
        self.format = format_
        self.buffer = ""
        self.inside = False  # after the format's open, before its close (or the end)
        self.started = False  # some content went out (an at_start format then has no call)
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the calls that `text` completes."""
        self.buffer += text
        content, calls = "", []
        while True:
            if self.inside:
                at = self.buffer.find(self.format.close) if self.format.close else -1
                if at < 0:
                    break  # the call goes on (to its close, or to the answer's end)
                raw, self.buffer, self.inside = self.buffer[:at], self.buffer[at + len(self.format.close):], False
                content += self._calls_or_text(raw, calls, closed=True)
                continue
            at = self._open_at()
            if at is None:  # maybe the start of a call: wait for more
                break
            if at < 0:
                held = 0 if self.format.at_start else _partial_suffix(self.buffer, self.format.open)
                content += self._content(self.buffer[:len(self.buffer) - held], calls)
                self.buffer = self.buffer[len(self.buffer) - held:]
                break
            if not self.format.at_start:  # before a bare call there is only a <|python_tag|>, not content
                content += self._content(self.buffer[:at], calls)
            # A bare JSON call (at_start) keeps its opening brace; a marker is dropped.
            self.buffer = self.buffer[at if self.format.at_start else at + len(self.format.open):]
            self.inside = True
        self.calls += len(calls)
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end: calls that run to the end are parsed now; anything else is content."""
        calls: list[ToolCall] = []
        rest = (self._calls_or_text(self.buffer, calls, closed=False) if self.inside
                else self._content(self.buffer, calls))
        self.buffer, self.inside = "", False
        self.calls += len(calls)
        return rest, calls

    def _open_at(self) -> int | None:
        """Where the calls open in the buffer (-1: nowhere); None while the buffer may still become their start."""
        if not self.format.at_start:
            return self.buffer.find(self.format.open)
        if self.started:
            return -1
        head = self.buffer.lstrip()
        if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
            return None
        body = head[len(PYTHON_TAG):].lstrip() if head.startswith(PYTHON_TAG) else head
        if not body:
            return None
        return len(self.buffer) - len(body) if body.startswith(self.format.open) else -1

    def _calls_or_text(self, raw: str, calls: list[ToolCall], closed: bool) -> str:
        """The calls in `raw` (what stood between the format's open and its close, or the end), appended to
        `calls`; where they are not well-formed calls of offered functions, the text as content."""
        found = self._parsed(raw)
        if found is None:
            opened = "" if self.format.at_start else self.format.open
            whole = opened + raw + (self.format.close if closed else "")
            return self._content(whole, calls)
        calls.extend(found)
        return ""

    def _parsed(self, raw: str) -> list[ToolCall] | None:
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or nested past what the parser follows: text
            return None
        items = value if self.format.listed and isinstance(value, list) else [value]
        if self.format.listed != isinstance(value, list) or not items:
            return None
        if not all(isinstance(item, dict) and item.get("name") in self.names for item in items):
            return None
        return [ToolCall(self._new_id(), item["name"], _as_json(item.get(self.format.arguments, {}))) for item in items]

    def _new_id(self) -> str:
        # Mistral's template refuses call ids that are not 9 letters or digits when they come back.
        return uuid.uuid4().hex[:9] if self.format is MISTRAL else f"call_{uuid.uuid4().hex[:24]}"

    def _content(self, text: str, calls: list[ToolCall]) -> str:
        """`text` as content, but for the line breaks between and after calls (the template's layout)."""
        if text and not text.isspace():
            self.started = True
        return "" if (self.calls or calls) and text.isspace() else text


def _as_json(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


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
