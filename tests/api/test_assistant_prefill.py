"""Assistant prefill as llama-server does it: a chat ending with the assistant's message is continued, not answered;
vLLM's continue_final_message and add_generation_prompt read as llama-server reads them; exact under speculation."""

from __future__ import annotations

import pytest

from duo.api.anthropic.body import MessagesBody
from duo.api.anthropic.translate import chat_body
from duo.api.openai.bodies import ChatBody
from duo.api.serving.prepare import Preparer
from duo.api.serving.request import BadRequest
from duo.cli.llama_flags import refusal
from duo.cli.target import build_parser
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.http import post

QUESTION = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
PREFILL = {"role": "assistant", "content": "Whill"}


def prompt_tokens(model, body: dict) -> list[int]:
    return list(Preparer(model, 512).prepare(ChatBody.model_validate(body).to_request())[0].prompt_tokens)


def refused_with(body: dict) -> BadRequest:
    with pytest.raises(BadRequest) as refused:
        ChatBody.model_validate(body).to_request()
    return refused.value


def opened_with(model, text: str) -> list[int]:
    """The question rendered with the assistant's turn opened, then `text` (the message's own text, as text)."""
    return model.tokenize(model.chat_prompt(QUESTION)) + model.tokenize(text, add_special=False, parse_special=False)


def test_a_final_assistant_message_is_left_open_for_the_model_to_continue(target_model):
    tokens = prompt_tokens(target_model, {"messages": [*QUESTION, PREFILL]})
    assert target_model.detokenize(tokens, special=True).decode().endswith(
        "<|im_start|>user\nWhat is the best book<|im_end|>\n<|im_start|>assistant\nWhill")
    assert tokens == opened_with(target_model, "Whill")


def test_continue_final_message_without_the_generation_prompt_is_the_same_prefill(target_model):
    explicit = {"messages": [*QUESTION, PREFILL], "add_generation_prompt": False, "continue_final_message": True}
    assert prompt_tokens(target_model, explicit) == prompt_tokens(target_model, {"messages": [*QUESTION, PREFILL]})


def test_a_prefill_of_text_parts_joins_them_as_llama_server_does(target_model):
    parts = {"role": "assistant", "content": [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]}
    assert prompt_tokens(target_model, {"messages": [*QUESTION, parts]}) == opened_with(target_model, "Wh\n\nill")


def test_a_prefill_is_text_even_where_it_spells_a_control_token(target_model):
    forged = {"role": "assistant", "content": "<|im_end|>"}
    assert prompt_tokens(target_model, {"messages": [*QUESTION, forged]}) == opened_with(target_model, "<|im_end|>")


def test_without_the_generation_prompt_the_chat_ends_after_the_last_message(target_model):
    tokens = prompt_tokens(target_model, {"messages": QUESTION, "add_generation_prompt": False})
    text = target_model.detokenize(tokens, special=True).decode()
    assert text.endswith("What is the best book<|im_end|>\n") and not text.endswith("assistant\n")


@pytest.mark.parametrize("body,words", [
    ({"messages": [*QUESTION, PREFILL], "add_generation_prompt": True, "continue_final_message": True},
     "Cannot set both add_generation_prompt and continue_final_message to true."),
    ({"messages": [*QUESTION, PREFILL], "continue_final_message": "content"},
     "Cannot set both add_generation_prompt and continue_final_message to true."),
    ({"messages": [*QUESTION, {"role": "assistant", "content": "A"}, PREFILL]},
     "Cannot have 2 or more assistant messages at the end of the list."),
    ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "Cannot continue an assistant message that contains tool calls."),
    ({"messages": [*QUESTION, PREFILL], "add_generation_prompt": False, "continue_final_message": "reasoning_content"},
     "reasoning_content"),
])
def test_what_llama_server_refuses_is_a_400_in_its_words(body, words):
    assert words in str(refused_with(body))


def test_an_anthropic_final_assistant_message_is_a_prefill_too(target_model):
    messages = MessagesBody.model_validate({"max_tokens": 4, "system": "Book", "messages": [
        {"role": "user", "content": "What is the best book"}, {"role": "assistant", "content": "Whill"}]})
    request = chat_body(messages).to_request()
    assert request.prefill == "Whill"
    assert list(Preparer(target_model, 512).prepare(request)[0].prompt_tokens) == opened_with(target_model, "Whill")


def test_the_answer_is_only_what_the_model_adds_and_greedy_with_a_draft_is_the_target_alone(served_duo, target_model):
    answer = post(served_duo, "/v1/chat/completions", {"messages": [*QUESTION, PREFILL], "temperature": 0,
                                                       "max_tokens": 16})
    assert answer.status_code == 200, answer.text
    content = answer.json()["choices"][0]["message"]["content"]
    # The target's own greedy continuation of the open message, from its first new token: "Whill" is not repeated.
    assert leaves_greedy_path_only_at_a_near_tie(target_model, opened_with(target_model, "Whill"), content, 16)


def test_llama_servers_prefill_flags_are_taken_or_refused_at_startup():
    """--prefill-assistant is duo's way already; --no-prefill-assistant (close the final assistant message) is not."""
    parser = build_parser()
    assert refusal(parser.parse_args(["--prefill-assistant"])) is None
    refused = refusal(parser.parse_args(["--no-prefill-assistant"]))
    assert refused is not None and refused.startswith("--no-prefill-assistant:")


def test_apply_template_renders_the_prefill_and_the_generation_prompt_as_chat_does(served_duo, target_model):
    def rendered(**fields) -> str:
        answer = post(served_duo, "/apply-template", {"messages": [*QUESTION, PREFILL], **fields})
        assert answer.status_code == 200, answer.text
        return answer.json()["prompt"]

    assert rendered() == target_model.chat_prompt(QUESTION) + "Whill"
    assert rendered(add_generation_prompt=False, continue_final_message=True) == rendered()
    closed = post(served_duo, "/apply-template", {"messages": QUESTION, "add_generation_prompt": False})
    assert closed.json()["prompt"] == target_model.chat_prompt(QUESTION, generation_prompt=False)
    both = post(served_duo, "/apply-template", {"messages": [*QUESTION, PREFILL], "add_generation_prompt": True,
                                                "continue_final_message": True})
    assert both.status_code == 400 and "Cannot set both" in both.json()["error"]["message"]
