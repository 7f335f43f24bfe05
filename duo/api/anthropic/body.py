"""The request bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as duo reads them."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from duo.api.serving.limits import INT32_MAX, MAX_STOP_STRINGS, Int32


class Loose(BaseModel):
    """A body part whose fields duo does not know are ignored, as llama-server ignores them: Anthropic's bookkeeping
    (cache_control, citations, a thinking block's signature, metadata, service_tier) changes nothing duo writes."""

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


class MessageBody(Loose):
    role: Literal["user", "assistant"]
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


class CountTokensBody(Loose):
    """POST /v1/messages/count_tokens: what renders the prompt, no generation settings."""

    model: str | None = None
    messages: list[MessageBody]
    system: Union[str, list[Block], None] = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoiceBody | None = None
    thinking: ThinkingBody | None = None

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

    def generation_fields(self) -> dict[str, Any]:
        fields = {"max_tokens": self.max_tokens, "stop": self.stop_sequences, "temperature": self.temperature,
                  "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream}
        return {name: value for name, value in fields.items() if value is not None}
