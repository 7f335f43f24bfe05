"""The request bodies of llama-server's native endpoints (/completion, /infill, /tokenize, /detokenize,
/apply-template), as scripts and editors written for llama.cpp send them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from duo.api.llama_server.prompts import one_prompt, prompts_of
from duo.api.openai.bodies import PART_DELIMITER, ChatMessageBody, template_messages
from duo.api.serving.bodies import GenerationBody, LlamaServerFields
from duo.api.serving.chat_tokens import Turn
from duo.api.serving.infill import FimInput
from duo.api.serving.prefill import chat_turn
from duo.api.serving.limits import INT32_MAX, MAX_RESPONSE_FIELD_LENGTH, MAX_RESPONSE_FIELDS, Int32
from duo.api.serving.request import CompletionRequest
from duo.api.tools import ToolBody


class NativeCompletionBody(GenerationBody):
    """llama-server's POST /completion: a raw prompt (text or token ids), n_predict, its code-completion stop rules
    (duo.api.serving.infill.FimStops) and response_fields (the answer's fields to send, "timings/prompt_n" for nested ones,
    each under its path)."""

    prompt: str | list[Any] | dict[str, Any]  # llama-server's forms (duo.api.llama_server.prompts)
    n_indent: int = Field(default=0, ge=0, le=INT32_MAX)
    t_max_predict_ms: Int32 = 0  # <= 0: no time limit
    t_max_prompt_ms: Int32 = 0   # accepted and not enforced, as llama-server leaves it (a prompt is read whole)
    response_fields: list[Annotated[str, Field(max_length=MAX_RESPONSE_FIELD_LENGTH)]] | None = Field(
        default=None, max_length=MAX_RESPONSE_FIELDS)

    def native_request(self, **prompt: Any) -> CompletionRequest:
        return self.completion_request(max_tokens=self.token_limit(), n_indent=self.n_indent,
                                       t_max_predict_ms=self.t_max_predict_ms, **prompt)

    def to_request(self) -> CompletionRequest:
        self.check_supported()
        return self.native_request(**one_prompt(self.prompt))

    def to_requests(self) -> list[CompletionRequest]:
        """A request per prompt: llama-server's batch (a list of prompts) answers each."""
        self.check_supported()
        return [self.native_request(**prompt) for prompt in prompts_of(self.prompt)]


class InputChunk(BaseModel):
    """One of /infill's input_extra: llama-server reads a chunk's filename and text, both required (a chunk without
    them is a 400 there); clients add bookkeeping of their own (llama.vim: when it picked the chunk), which changes
    no answer and is ignored."""

    model_config = ConfigDict(extra="ignore")
    filename: str
    text: str


class InfillBody(NativeCompletionBody):
    """llama-server's POST /infill: the text before the hole (`prompt`: the cursor's line so far, after it), after
    it, and chunks of other files; the prompt is the model's FIM layout of them (duo.api.serving.infill)."""

    prompt: str | list[int] = ""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InputChunk] = Field(default_factory=list)

    def to_request(self) -> CompletionRequest:
        self.check_supported()
        extra = tuple((chunk.filename, chunk.text) for chunk in self.input_extra)
        prompt = tuple(self.prompt) if isinstance(self.prompt, list) else self.prompt
        return self.native_request(fim=FimInput(self.input_prefix, self.input_suffix, extra, prompt))

    def to_requests(self) -> list[CompletionRequest]:
        """/infill's one request: its prompt is the text before the hole, never a batch."""
        return [self.to_request()]


class TokenizeBody(LlamaServerFields):
    """llama-server's POST /tokenize."""

    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeBody(LlamaServerFields):
    """llama-server's POST /detokenize."""

    tokens: list[int]


class ApplyTemplateBody(LlamaServerFields):
    """llama-server's POST /apply-template: the chat as the model's template renders it, not generated from."""

    messages: list[ChatMessageBody]
    tools: list[ToolBody] | None = None
    add_generation_prompt: bool | None = None           # as on chat (duo.api.serving.prefill)
    continue_final_message: bool | str | None = None

    def turn(self) -> tuple[Sequence[Mapping[str, Any]], Turn]:
        """The messages the template renders and how the prompt ends (a prefill), as for a chat completion."""
        messages, turn = chat_turn(template_messages(self.messages), add_generation_prompt=self.add_generation_prompt,
                                   continue_final_message=self.continue_final_message)
        if turn.prefill is not None:  # a prefill's text parts are joined as llama-server joins them
            turn = replace(turn, prefill=self.messages[-1].text(len(self.messages) - 1, PART_DELIMITER))
        return messages, turn

