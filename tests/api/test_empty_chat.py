"""A chat of no message is answered as llama-server answers it: the template renders the empty conversation (its
generation prompt, and whatever it writes by default), on /v1/messages and on chat completions alike; an item of an
undefined value is undefined, as llama.cpp's engine reads it (Qwen's template reads messages[0]['role'])."""

from __future__ import annotations

from pathlib import Path

import pytest

from duo.api.openai.bodies import ChatBody
from duo.llama.templates.render import ChatTemplate
from helpers.http import post
from helpers.processes import start

# A template that writes each message and, asked, the assistant's turn: no message renders the turn alone.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_no_message_is_a_chat_for_the_template_to_render():
    request = ChatBody(messages=[], max_tokens=4).to_request()
    assert request.chat and not request.messages and request.prompt == ""


@pytest.fixture(scope="module")
def served_template(tiny_target: Path, process_logs: Path):
    process = start("duo.cli.target", ["--model", str(tiny_target), "--chat-template", TEMPLATE], process_logs,
                    http=True)
    yield process
    process.stop()


def test_messages_api_answers_an_empty_conversation(served_template):
    response = post(served_template, "/v1/messages", {"model": "duo", "max_tokens": 4, "messages": []})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["type"] == "message" and answer["usage"]["output_tokens"] > 0


def test_chat_completions_render_the_generation_prompt_alone(served_template):
    response = post(served_template, "/v1/chat/completions", {"messages": [], "max_tokens": 4, "verbose": True})
    assert response.status_code == 200, response.text
    assert response.json()["__verbose"]["prompt"].endswith("<|im_start|>assistant\n")
    assert response.json()["usage"]["prompt_tokens"] > 0


def test_an_item_of_an_undefined_value_is_undefined_as_llama_cpps_engine_reads_it():
    template = ChatTemplate("{% if messages[0]['role'] == 'system' %}{{ messages[0].content }}{% else %}default"
                            "{% endif %}", bos_token="", eos_token="")
    assert template.render([]) == "default"


def test_the_models_own_template_renders_no_message_with_its_default_system_turn(served_alone):
    response = post(served_alone, "/v1/chat/completions", {"messages": [], "max_tokens": 4, "verbose": True})
    assert response.status_code == 200, response.text
    prompt = response.json()["__verbose"]["prompt"]
    assert "You are Qwen" in prompt and prompt.endswith("<|im_start|>assistant\n")
    anthropic = post(served_alone, "/v1/messages", {"model": "duo", "max_tokens": 4, "messages": []})
    assert anthropic.status_code == 200 and anthropic.json()["type"] == "message", anthropic.text
