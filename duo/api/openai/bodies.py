"""The request bodies of OpenAI's /v1/completions and /v1/chat/completions, and their translation into duo's
CompletionRequest."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from duo.api.serving.bodies import MAX_TOP_LOGPROBS, GenerationBody, LlamaServerFields
from duo.api.serving.infill import FimInput
from duo.api.serving.limits import INT32_MAX, Int32
from duo.api.serving.prefill import chat_turn
from duo.api.serving.request import BadRequest, CompletionRequest
from duo.api.tools import FunctionBody, ToolBody, ToolChoice, ToolError, template_message, tool_use


class CompletionBody(GenerationBody):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int]
    # Left out: until the end of generation or of the context, as llama-server (OpenAI's own API stops at 16).
    max_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    echo: bool | None = False
    suffix: str | None = None
    best_of: Int32 | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # legacy: the alternatives per token

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise BadRequest("echo is not supported", param="echo")
        if self.post_sampling_probs:
            raise BadRequest("post_sampling_probs is not supported on /v1/completions, whose logprobs are OpenAI's "
                             "log-probabilities; use /completion (llama-server's) or /v1/chat/completions",
                             param="post_sampling_probs")
        if self.best_of not in (None, self.n or self.n_cmpl or 1):
            raise BadRequest(f"best_of must equal n ({self.n or self.n_cmpl or 1}): duo returns every choice it "
                             f"generates, it does not rank them; got {self.best_of}", param="best_of")

    def logprob_count(self) -> int:
        return self.logprobs if self.logprobs is not None else super().logprob_count()

    def to_request(self) -> CompletionRequest:
        self.check_supported()
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise BadRequest(f"send one prompt per request, got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        if self.suffix:  # the text after the hole: the model's fill-in-the-middle prompt (duo.api.serving.infill)
            if not isinstance(prompt, str):
                raise BadRequest("suffix needs the prompt as text (the code before the hole)", param="suffix")
            return self.completion_request(max_tokens=self.token_limit(), fim=FimInput(prompt, self.suffix))
        if isinstance(prompt, list):
            return self.completion_request(max_tokens=self.token_limit(), prompt_tokens=prompt)
        return self.completion_request(max_tokens=self.token_limit(), prompt=prompt)


# How llama-server joins the text parts of a prefill (common_chat_msg::render_content).
PART_DELIMITER = "\n\n"


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON


class ToolCallBody(BaseModel):
    """A call in an earlier assistant message, sent back with the tool's result."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessageBody(LlamaServerFields):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # a participant's name: chat templates do not render it, nor does llama-server
    tool_calls: list[ToolCallBody] | None = None  # an assistant's calls
    tool_call_id: str | None = None               # a tool's result: the call it answers
    reasoning_content: str | None = None          # an assistant's reasoning, as llama-server hands it to the template

    def text(self, index: int, delimiter: str = "") -> str:
        """The message's text, its parts joined by `delimiter`; only text parts can be rendered by a chat template."""
        if not isinstance(self.content, list):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise BadRequest(f"messages[{index}].content: only text parts are supported, got a {part.type!r} "
                                 "part", param=f"messages[{index}].content")
        return delimiter.join(part.text or "" for part in self.content)


class ChatBody(GenerationBody):
    """POST /v1/chat/completions."""

    LIMIT_NAMES: ClassVar[tuple[str, ...]] = ("max_completion_tokens", "max_tokens")
    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolBody] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # llama-server's: how the model's <think> reasoning is told from its content ("auto" as llama-server's default,
    # deepseek: reasoning_content), and more variables for the chat template ({"enable_thinking": false}).
    reasoning_format: Literal["none", "auto", "deepseek", "deepseek-legacy"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # The template's add_generation_prompt, and vLLM's continue_final_message (true, "content"): read as llama-server
    # reads them (duo.api.serving.prefill).
    add_generation_prompt: bool | None = None
    continue_final_message: bool | str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")

    def to_request(self) -> CompletionRequest:
        self.check_supported()
        try:
            use = tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolError as error:
            raise BadRequest(str(error), param=error.param) from error
        messages, turn = chat_turn(template_messages(self.messages), add_generation_prompt=self.add_generation_prompt,
                                   continue_final_message=self.continue_final_message)
        if turn.prefill is not None:  # a prefill's text parts are joined as llama-server joins them
            turn = replace(turn, prefill=self.messages[-1].text(len(self.messages) - 1, PART_DELIMITER))
        # No message at all is a chat all the same: the template renders it as llama-server's does.
        return self.completion_request(max_tokens=self.token_limit(), messages=messages, prefill=turn.prefill,
                                       chat=True, generation_prompt=turn.generation_prompt, tool_use=use,
                                       reasoning_format="deepseek" if self.reasoning_format in (None, "auto") else
                                       self.reasoning_format, chat_template_kwargs=self.chat_template_kwargs)

    def logprob_count(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else super().logprob_count()

    def callable_functions(self) -> list[FunctionBody]:
        """The functions whose calls the answer parses out of the model's text (none: all of it is content)."""
        try:
            use = tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolError:
            return []  # to_request says what is wrong
        return use.callable if use else []


def template_messages(messages: list[ChatMessageBody]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (duo.api.tools.template_message); BadRequest for a field of a
    message that duo does not honour."""
    for i, message in enumerate(messages):
        message.check_fields(f"messages[{i}].")
    try:
        return [template_message("system" if m.role == "developer" else m.role, m.text(i),
                                 [call.model_dump() for call in m.tool_calls] if m.tool_calls else None,
                                 m.tool_call_id, m.reasoning_content) for i, m in enumerate(messages)]
    except ToolError as error:
        raise BadRequest(str(error), param=error.param) from error
