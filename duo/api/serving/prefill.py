"""Assistant prefill as llama-server reads it: a chat whose final message the model continues instead of answering."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from duo.api.serving.chat_tokens import Turn
from duo.api.serving.request import BadRequest


def continuation_of(value: Any) -> bool:
    """Whether `continue_final_message` (vLLM's, read as llama-server reads it) asks to continue: true, "content" or
    "reasoning_content" do; anything else (false, null, another string) does not."""
    return value is True or value in ("content", "reasoning_content")


def chat_turn(messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool | None = None,
              continue_final_message: Any = None,
              prefill_assistant: bool = True) -> tuple[Sequence[Mapping[str, Any]], Turn]:
    """The messages the template renders and how the prompt ends, by llama-server's rules: a final assistant message
    is continued (unless prefill_assistant is off), or any final message when the client sends
    continue_final_message; the contradictions llama-server refuses are BadRequest in its words.

    To continue, the final message is taken off the chat, the rest is rendered with the generation prompt (the
    opening of the assistant's turn), and the prompt ends with the message's text, left open: no end of turn, so the
    model writes on from it and the answer is only what it adds (`<|im_start|>assistant\\nWhill` goes on `iam`)."""
    generation_prompt = True if add_generation_prompt is None else add_generation_prompt
    continuing = continuation_of(continue_final_message)
    if continue_final_message == "reasoning_content":
        raise BadRequest("continue_final_message: \"reasoning_content\" is not supported: duo continues a message's "
                         "content (send true or \"content\")", param="continue_final_message")
    if not continuing and prefill_assistant and messages and messages[-1].get("role") == "assistant":
        if len(messages) >= 2 and messages[-2].get("role") == "assistant":
            raise BadRequest("Cannot have 2 or more assistant messages at the end of the list.", param="messages")
        continuing, generation_prompt = True, False
    if not continuing:
        return messages, Turn(generation_prompt=generation_prompt)
    if generation_prompt:
        raise BadRequest("Cannot set both add_generation_prompt and continue_final_message to true.",
                         param="continue_final_message")
    if not messages:
        return messages, Turn(generation_prompt=False)
    final = messages[-1]
    if final.get("role") == "assistant" and final.get("tool_calls"):
        raise BadRequest("Cannot continue an assistant message that contains tool calls.", param="messages")
    # The rest is rendered with the assistant's opening, as llama-server appends the template's generation prompt.
    return messages[:-1], Turn(prefill=str(final.get("content") or ""), generation_prompt=True)
