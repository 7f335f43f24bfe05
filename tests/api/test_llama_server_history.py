"""Smaller differences from llama-server that its suite exercises: an answer's reasoning in the history reaches the
template (Anthropic thinking blocks, chat's reasoning_content), /infill's input_extra chunks need their filename and
text, and a warm-up (max_tokens 0) still has its response_format checked."""

from __future__ import annotations

import pytest

from duo.api.anthropic.body import CountTokensBody
from duo.api.anthropic.translate import chat_body
from duo.api.openai.bodies import ChatBody, template_messages
from helpers.http import post

CALL = {"type": "tool_use", "id": "call_1", "name": "list_files", "input": {"path": "."}}


def test_a_thinking_block_in_the_history_is_the_answers_reasoning_content():
    body = CountTokensBody.model_validate({"messages": [
        {"role": "user", "content": "Fix the bug"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look first. ", "signature": "x"},
                                          {"type": "thinking", "thinking": "Then fix."}, CALL]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Reasoning alone."}]},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "EnCrYpTeD"},
                                          {"type": "text", "text": "Hello."}]}]})
    _, answer, alone, redacted = template_messages(chat_body(body).messages)
    assert answer["reasoning_content"] == "Look first. Then fix." and answer["tool_calls"]
    assert alone == {"role": "assistant", "content": "", "reasoning_content": "Reasoning alone."}  # kept, not dropped
    assert redacted == {"role": "assistant", "content": "Hello."}  # encrypted for Anthropic's models: left out


def test_a_chat_messages_reasoning_content_reaches_the_template():
    chat = ChatBody.model_validate({"messages": [
        {"role": "user", "content": "Fix the bug"},
        {"role": "assistant", "content": "", "reasoning_content": "Check the layout first.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "list_files", "arguments": "{\"path\": \".\"}"}}]}]})
    assert template_messages(chat.messages)[1]["reasoning_content"] == "Check the layout first."


@pytest.mark.parametrize("chunk", [{}, {"filename": "ok"}, {"text": "abc"}])
def test_an_infill_chunk_without_its_filename_or_text_is_a_400(served_alone, chunk):
    response = post(served_alone, "/infill", {"input_extra": [chunk], "input_prefix": "int main() {\n",
                                              "prompt": "    int n = ", "input_suffix": "}\n", "n_predict": 4})
    assert response.status_code == 400 and "input_extra" in response.json()["error"]["message"]


def test_a_warm_up_still_has_its_response_format_checked(served_alone):
    messages = [{"role": "user", "content": "Write an example"}]
    for schema in ({"type": 123}, {"type": "hiccup"}):
        response = post(served_alone, "/v1/chat/completions", {
            "messages": messages, "max_tokens": 0, "response_format": {"type": "json_object", "schema": schema}})
        assert response.status_code == 400, (schema, response.text)
    valid = post(served_alone, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 0, "response_format": {"type": "json_object", "schema": {"const": "42"}}})
    assert valid.status_code == 200 and valid.json()["usage"]["completion_tokens"] == 0
