"""A chat template renders as llama-server renders it: today's date in its variables and strftime_now,
enable_thinking true unless the launch line or the request says otherwise (the request's word last), and a string
joined with an undefined or none value as llama.cpp's Jinja engine joins it."""

from __future__ import annotations

from datetime import date, datetime
from pathlib import Path

import pytest

from duo.llama.model import Model, ModelError
from duo.llama.templates import ChatTemplate
from helpers.templates import THINKING

USER = [{"role": "user", "content": "What is today?"}]
NOW = datetime(2026, 11, 28, 21, 5)


def render(source: str, defaults: dict | None = None, variables: dict | None = None, tools: list | None = None) -> str:
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>", defaults=defaults, clock=lambda: NOW)
    return template.render(USER, tools or (), variables)


def test_templates_get_todays_date_in_llama_servers_variables_and_strftime_now():
    """Llama 3.3's template prints date_string (its default otherwise: 26 Jul 2024), firefunction-v2's datetime."""
    assert render("{{ date_string }}|{{ datetime }}|{{ strftime_now('%d %b %Y') }}") == \
        "28 Nov 2026|Nov 28 2026|28 Nov 2026"
    assert render("{{ date_string }}", variables={"date_string": "1 Jan 2000"}) == "1 Jan 2000"  # the client's wins


def test_a_string_joined_with_an_undefined_or_none_value_reads_it_as_empty_as_llama_cpp():
    """firefunction-v2 adds `functions` (undefined: llama-server passes none) to its system prompt."""
    assert render("{{ 'Available functions:' + '\\n' + functions + '!' }}") == "Available functions:\n!"
    assert render("{{ none_value + 'x' }}", variables={"none_value": None}) == "x"
    assert render("{{ 1 + 2 }}") == "3"


def test_enable_thinking_is_true_by_default_the_launch_lines_under_the_requests():
    assert render(THINKING).endswith("<|im_start|>assistant\n<think>\n")  # llama-server's --reasoning auto
    off = {"enable_thinking": False}
    assert render(THINKING, defaults=off).endswith("<think>\n</think>")
    assert render(THINKING, defaults=off, variables={"enable_thinking": True}).endswith("<think>\n")
    assert render(THINKING, defaults={"enable_thinking": True}, variables=off).endswith("<think>\n</think>")
    assert render(THINKING, defaults=off, variables={"other": 1}).endswith("</think>")  # merged one by one


def test_the_model_renders_its_template_with_the_launch_lines_variables_and_todays_date(tiny_target: Path):
    model = Model(tiny_target, chat_template=THINKING + "|{{ date_string }}|{{ datetime }}",
                  template_variables={"enable_thinking": False})
    try:
        prompt = model.chat_prompt(USER)
        today = date.today()
        assert prompt.endswith(f"<think>\n</think>|{today.strftime('%d %b %Y')}|{today.strftime('%b %d %Y')}")
        assert "</think>" not in model.chat_prompt(USER, variables={"enable_thinking": True})
    finally:
        model.close()


def test_a_template_that_fails_on_the_messages_is_a_model_error_naming_it(tiny_target: Path):
    model = Model(tiny_target, chat_template="{{ messages[0].content + 1 }}")
    try:
        with pytest.raises(ModelError, match="chat template rejected the messages"):
            model.chat_prompt(USER)
    finally:
        model.close()
