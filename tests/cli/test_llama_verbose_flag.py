"""llama-server's -v/--verbose (and -lv above 9) on duo-target: every whole chat or completions answer carries its
native answer as __verbose, an assistant's prefill included, as llama-server's verbose answers do."""

from __future__ import annotations

from pathlib import Path

import pytest

from duo.api.serving.defaults import LLAMA_SERVER_SAMPLING
from duo.cli.llama_launch import server_defaults
from duo.cli.target import build_parser
from helpers.http import post
from helpers.processes import start


def defaults(line: str) -> dict:
    return dict(server_defaults(build_parser().parse_args(line.split())).fields)


@pytest.mark.parametrize("line", ["-v", "--verbose", "--log-verbose", "-lv 10", "--verbosity 99"])
def test_a_verbose_launch_line_makes_verbose_the_servers_default(line):
    assert defaults(line) == {**LLAMA_SERVER_SAMPLING, "verbose": True}


def test_a_verbosity_of_nine_or_less_is_not_verbose():
    assert defaults("-lv 9").get("verbose", False) is False


def test_a_verbose_server_answers_a_prefilled_chat_with_its_prompt_ending_in_the_prefill(tiny_target: Path,
                                                                                          process_logs: Path):
    process = start("duo.cli.target", ["--model", str(tiny_target), "-v"], process_logs, http=True)
    try:
        messages = [{"role": "user", "content": "What is the best book"}, {"role": "assistant", "content": "Whill"}]
        prefilled = post(process, "/chat/completions", {"messages": messages, "max_tokens": 4})
        assert prefilled.status_code == 200, prefilled.text
        native = prefilled.json()["__verbose"]
        assert native["prompt"].endswith("What is the best book<|im_end|>\n<|im_start|>assistant\nWhill")
        quiet = post(process, "/chat/completions", {"messages": messages, "max_tokens": 4, "verbose": False})
        assert "__verbose" not in quiet.json()  # the request's own field wins
    finally:
        process.stop()
