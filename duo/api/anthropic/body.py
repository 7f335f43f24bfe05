"""The request bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as duo reads them."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from duo.api.serving.limits import INT32_MAX, MAX_STOP_STRINGS, Int32
from duo.api.serving.request import BadRequest


class Loose(BaseModel):
    """A body part whose fields duo does not know are ignored, as llama-server ignores them: Anthropic's bookkeeping
    (cache_control, citations, a thinking block's signature, metadata, service_tier, speed, container, diagnostics)
    changes nothing duo writes, nor do the settings of Anthropic's own service: context_management (its edits clear
    earlier thinking or old tool results past a threshold; llama-server makes none either), a tool's defer_loading,
    eager_input_streaming and cache_control (duo renders every tool and streams each call's input whole)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextBlock(Loose):
    """A block of a tool_result's content: Anthropic's are text or images, and duo.api.anthropic.translate renders
    text alone. It holds no blocks of its own, so that pydantic validates no deeper than the bounds were checked
    (duo.api.serving.limits.PROMPT_LISTS)."""

    type: str
    text: str | None = None


class Block(TextBlock):
    """One content block of any type; duo.api.anthropic.translate says which types duo renders, and refuses the rest
    by name. `content` is a tool_result's: a string or text blocks."""

    id: str | None = None            # tool_use
    name: str | None = None          # tool_use
    input: Any = None                # tool_use: the call's arguments, a JSON object
    tool_use_id: str | None = None   # tool_result: the call it answers
    content: Union[str, list[TextBlock], None] = None  # tool_result
    is_error: bool | None = None     # tool_result: the result text says what failed; templates have no field for it
    thinking: str | None = None      # thinking: an answer's reasoning, the template's reasoning_content


class MessageBody(Loose):
    """A turn of the conversation; a system one (Claude Code's beta mid-conversation-system-2026-04-07) is an
    instruction given where it stands, after the turns before it."""

    role: Literal["user", "assistant", "system"]
    content: Union[str, list[Block]]


class ToolDefinition(Loose):
    """A client tool ({name, description, input_schema}); a server tool (web search, code execution, ...) carries
    a `type` naming it, which duo refuses: it has no such tool to run."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent: a client tool


class ToolChoiceBody(Loose):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type tool: the tool the model must call
    disable_parallel_tool_use: bool | None = None


class ThinkingBody(Loose):
    """Extended thinking: on (enabled, adaptive) or off (disabled); the budget is not enforced."""

    type: str
    budget_tokens: int | None = None


class OutputFormat(Loose):
    """output_config.format: the JSON schema that the answer's text must match (structured outputs)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Loose):
    """output_config. effort (low ... max: how much a Claude model thinks) and task_budget steer Anthropic's own
    models, and llama-server reads neither: ignored."""

    format: OutputFormat | None = None


class CountTokensBody(Loose):
    """POST /v1/messages/count_tokens: what renders the prompt, no generation settings."""

    model: str | None = None
    messages: list[MessageBody]
    system: Union[str, list[Block], None] = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoiceBody | None = None
    thinking: ThinkingBody | None = None
    mcp_servers: list[Any] | None = None  # remote MCP servers whose tools Anthropic offers the model

    def check_served(self) -> None:
        """BadRequest naming a field that would change the prompt and that duo cannot honour."""
        if self.mcp_servers:
            raise BadRequest("mcp_servers: duo-target connects to no MCP server, so their tools cannot be offered to "
                             "the model; run them in the client and send their tools as client tools",
                             param="mcp_servers")

    def generation_fields(self) -> dict[str, Any]:
        """The chat fields that steer generation (none: nothing is generated)."""
        return {}


class MessagesBody(CountTokensBody):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1, le=INT32_MAX)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    stream: bool = False
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the older place of output_config.format
    # Anthropic's service keeps state or rewrites the conversation for these (count_tokens ignores them, as
    # Anthropic's does): a summary in place of an answer, a conversation held on the server.
    compaction: dict[str, Any] | None = None
    thread: dict[str, Any] | None = None

    def check_served(self) -> None:
        super().check_served()
        if self.compaction is not None:
            raise BadRequest("compaction: duo-target does not summarize conversations into compaction blocks; ask "
                             "for the summary in a message instead", param="compaction")
        if self.thread is not None and self.thread.get("type") != "create":
            raise BadRequest("thread: duo-target holds no conversation state; send the whole conversation in "
                             "messages", param="thread")

    def generation_fields(self) -> dict[str, Any]:
        fields = {"max_tokens": self.max_tokens, "stop": self.stop_sequences, "temperature": self.temperature,
                  "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream,
                  "json_schema": self.answer_schema()}
        return {name: value for name, value in fields.items() if value is not None}

    def answer_schema(self) -> dict[str, Any] | None:
        """The schema the answer must match (output_config.format, or output_format where the SDK is older)."""
        newer = self.output_config.format if self.output_config else None
        if newer and self.output_format:
            raise BadRequest("output_format: send output_config.format or output_format (its older place), not both",
                             param="output_format")
        given = newer or self.output_format
        return given.schema_ if given else None
