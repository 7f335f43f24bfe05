"""duo-target started with llama-server's --reasoning off renders every chat with enable_thinking false: the prompt
/apply-template shows is the one chat completions, Responses and Anthropic Messages generate from (a thinking
template's think block closed), a request's chat_template_kwargs.enable_thinking still wins, and under speculation
the answer is the target's greedy one alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import CONTEXT_SIZE
from helpers.http import post
from helpers.processes import start, wait_for_draft
from helpers.templates import THINKING

QUESTION = "What is today?"
MESSAGES = [{"role": "user", "content": QUESTION}]
LIMIT = 16


@pytest.fixture(scope="module")
def thinking_off(tiny_target: Path, served_draft, process_logs: Path, tmp_path_factory: pytest.TempPathFactory):
    """duo-target with --reasoning off and a thinking template, greedy (--temp 0), speculating with a draft."""
    template = tmp_path_factory.mktemp("templates") / "thinking.jinja"
    template.write_text(THINKING)
    process = start("duo.cli.target", ["-m", str(tiny_target), "-c", str(CONTEXT_SIZE), "--temp", "0",
                                       "--reasoning", "off", "--jinja", "--chat-template-file", str(template),
                                       "--peer", served_draft.address, "--draft-max", "4"], process_logs, http=True)
    wait_for_draft(process.address)
    yield process
    process.stop()


def alone(served_alone, prompt: str) -> tuple[str, int]:
    """The target alone's greedy completion of `prompt` (the rendered chat) and its prompt's tokens."""
    answer = post(served_alone, "/v1/completions", {"prompt": prompt, "max_tokens": LIMIT, "temperature": 0}).json()
    return answer["choices"][0]["text"], answer["usage"]["prompt_tokens"]


def test_apply_template_renders_the_think_block_closed(thinking_off):
    prompt = post(thinking_off, "/apply-template", {"messages": MESSAGES}).json()["prompt"]
    assert prompt == f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n<think>\n</think>"


def test_every_protocol_generates_from_the_prompt_apply_template_shows(thinking_off, served_alone):
    prompt = post(thinking_off, "/apply-template", {"messages": MESSAGES}).json()["prompt"]
    text, prompt_tokens = alone(served_alone, prompt)
    chat = post(thinking_off, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": LIMIT}).json()
    assert chat["choices"][0]["message"]["content"] == text and chat["usage"]["prompt_tokens"] == prompt_tokens
    anthropic = post(thinking_off, "/v1/messages", {"messages": MESSAGES, "max_tokens": LIMIT}).json()
    usage = anthropic["usage"]  # Anthropic's input_tokens leaves out the tokens read from the prompt cache
    assert anthropic["content"][-1]["text"] == text
    assert usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) == prompt_tokens
    responses = post(thinking_off, "/v1/responses", {"input": QUESTION, "max_output_tokens": LIMIT}).json()
    said = "".join(part["text"] for item in responses["output"] if item["type"] == "message"
                   for part in item["content"])
    assert said == text and responses["usage"]["input_tokens"] == prompt_tokens


def test_a_requests_enable_thinking_wins_over_the_launch_lines(thinking_off, served_alone):
    opened = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n<think>\n"
    _, prompt_tokens = alone(served_alone, opened)
    chat = post(thinking_off, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": LIMIT,
                                                       "chat_template_kwargs": {"enable_thinking": True}}).json()
    assert chat["usage"]["prompt_tokens"] == prompt_tokens
