"""The body of POST /v1/responses (OpenAI's Responses API): what duo honours, refuses by name, or ignores."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from duo.api.serving.limits import INT32_MAX, Int32
from duo.api.serving.request import BadRequest


class Loose(BaseModel):
    """A body part whose unknown fields are ignored, as llama-server ignores them: the Responses API grows new
    bookkeeping fields often, and clients (the Agents SDK, Codex) send back items with ids and statuses."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class Part(Loose):
    """A content part: input_text / output_text carry text; images, files and audio are refused."""

    type: str
    text: str | None = None


class InputItem(Loose):
    """One item of `input`: a message (`type` may be left out), a function_call or custom_tool_call the model made
    earlier, or the function_call_output / custom_tool_call_output answering one; other item types are refused by
    name."""

    type: str = "message"
    role: str | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None  # a function_call of a namespace's function (Codex sends it back as it got it)
    arguments: str | None = None
    input: str | None = None  # a custom_tool_call's
    output: str | list[Part] | None = None


class Tool(Loose):
    """A tool in the Responses shape: a function (flat, not nested under `function`), a namespace of functions and
    custom tools (`tools`), a custom tool taking free text (`format`: text, or a grammar its input follows), or a
    tool OpenAI's servers run (web_search...), which duo leaves out as llama-server does."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # either way a required call matches its parameters' schema
    tools: list[Tool] | None = None
    format: dict[str, Any] | None = None


# Tools that OpenAI's servers run (or that need a server-side runtime): no chat template can offer them, and
# llama-server leaves them out of the prompt (Codex offers web_search in every request, tool_search with some models).
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11",
                          "web_search_2025_08_26", "file_search", "image_generation", "code_interpreter",
                          "computer", "computer_use_preview", "mcp", "local_shell", "shell", "apply_patch",
                          "tool_search", "programmatic_tool_calling"})
CALLED_TOOLS = ("function", "custom")


class NamedTool(Loose):
    """tool_choice naming one function or custom tool: {"type": "function" | "custom", "name": ...}, a namespace's
    function with its `namespace` too."""

    type: str
    name: str | None = None
    namespace: str | None = None


class TextFormat(Loose):
    """text.format: plain text, any JSON object, or JSON matching `schema` (what the SDK's parse() sends)."""

    type: str = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # either way the output matches the schema: masking is never best-effort


class TextConfig(Loose):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint for OpenAI's own models; nothing duo's template can say


TEXT_FORMATS = ("text", "json_object", "json_schema")
ToolChoice = Literal["none", "auto", "required"] | NamedTool


class ResponsesBody(Loose):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None  # a system message before the input (not carried over by previous_response_id)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stream: bool | None = False
    previous_response_id: str | None = None
    store: bool | None = None  # false: the response is not held for a later previous_response_id
    # Honoured where the chat endpoint honours them, for clients that pass extra sampling fields through.
    seed: int | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    timings_per_token: bool = False  # llama-server's: each streamed event carries the timings so far
    return_progress: bool = False    # llama-server's: a stream tells how far its prompt's read got (prompt_progress)
    # Echoed, and otherwise ignored: they change nothing duo returns (reasoning: duo's models reason as their
    # template says, or not at all; truncation: a prompt past the context is a 400 either way).
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    # Refused where set: OpenAI's server-side features duo has no equivalent of.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        """Refuse, naming the field, what duo cannot do rather than silently ignoring it."""
        if self.background:
            raise BadRequest("background responses are not supported by duo-target; leave background out",
                             param="background")
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                raise BadRequest(f"{name} is not supported by duo-target (it holds no conversations or prompt "
                                 "templates); send the input itself", param=name)
        if self.top_logprobs:
            raise BadRequest("top_logprobs is not supported on /v1/responses; use /v1/chat/completions with "
                             "logprobs", param="top_logprobs")
        for i, tool in enumerate(self.tools or []):
            check_tool(tool, f"tools[{i}]")
        if isinstance(self.tool_choice, NamedTool) and (self.tool_choice.type not in CALLED_TOOLS or
                                                        not self.tool_choice.name):
            raise BadRequest("tool_choice takes none, auto, required or {\"type\": \"function\" or \"custom\", "
                             f"\"name\": ...}}; got type {self.tool_choice.type!r}", param="tool_choice")
        text_format = self.text.format if self.text else None
        if text_format and text_format.type not in TEXT_FORMATS:
            raise BadRequest(f"text.format.type {text_format.type!r} is not supported; duo takes "
                             f"{', '.join(TEXT_FORMATS)}", param="text.format.type")
        if text_format and text_format.type == "json_schema" and text_format.schema_ is None:
            raise BadRequest("text.format of type json_schema needs its schema: the JSON schema the answer must "
                             "match", param="text.format.schema")

    def echo(self) -> dict[str, Any]:
        """The request's settings as a response repeats them (the SDK reads tools, tool_choice, text...)."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": self.previous_response_id,
                "reasoning": self.reasoning or {"effort": None, "summary": None},
                "store": self.store is not False, "temperature": 1.0 if self.temperature is None else self.temperature,
                "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)
                         if self.text and self.text.format else {"type": "text"}},
                "tool_choice": self.tool_choice.model_dump(exclude_none=True)
                if isinstance(self.tool_choice, NamedTool) else self.tool_choice or "auto",
                "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or []],
                "top_p": 1.0 if self.top_p is None else self.top_p, "truncation": self.truncation or "disabled",
                "user": self.user, "service_tier": self.service_tier or "default", "background": False}


def check_tool(tool: Tool, where: str) -> None:
    """BadRequest naming what a tool lacks, or a type duo can neither offer nor leave out as llama-server does."""
    if tool.type in HOSTED_TOOLS:
        return
    if tool.type not in (*CALLED_TOOLS, "namespace"):
        raise BadRequest(f"{where}.type {tool.type!r} is not supported by duo-target; it offers function, namespace "
                         "and custom tools, and leaves out those OpenAI's servers run: "
                         f"{', '.join(sorted(HOSTED_TOOLS))}", param=f"{where}.type")
    if not tool.name:
        raise BadRequest(f"{where}.name is missing: a {tool.type} tool needs its name", param=f"{where}.name")
    if tool.type == "namespace":
        if not tool.tools:
            raise BadRequest(f"{where}.tools is missing: a namespace holds the functions it offers",
                             param=f"{where}.tools")
        for j, member in enumerate(tool.tools):
            if member.type not in CALLED_TOOLS:
                raise BadRequest(f"{where}.tools[{j}].type {member.type!r} is not supported: a namespace holds "
                                 "function and custom tools", param=f"{where}.tools[{j}].type")
            check_tool(member, f"{where}.tools[{j}]")
    if tool.type == "custom" and tool.format:
        check_custom_format(tool.format, f"{where}.format")


def check_custom_format(format_: dict[str, Any], where: str) -> None:
    """A custom tool's input is text, or follows a grammar: a Lark one or a regular expression."""
    if format_.get("type") not in ("text", "grammar"):
        raise BadRequest(f"{where}.type {format_.get('type')!r} is not supported: a custom tool's input is text, or "
                         "follows a grammar", param=f"{where}.type")
    if format_.get("type") == "grammar" and (format_.get("syntax") not in ("lark", "regex") or
                                             not isinstance(format_.get("definition"), str)):
        raise BadRequest(f"{where} needs its syntax (lark or regex) and its definition, the grammar as a string",
                         param=f"{where}.syntax")
