"""llama-server's chat template flags on duo-target: --chat-template names of llama.cpp's built-in templates,
--reasoning and --reasoning-budget as the template's enable_thinking, --chat-template-kwargs as its variables."""

from __future__ import annotations

import pytest

from duo.cli.llama_launch import chat_template, template_options, template_variables
from duo.cli.target import main
from duo.llama.templates import BUILTIN_SOURCES, ChatTemplate, reserved_names
from helpers.flags import target_flags


@pytest.mark.parametrize("name, system, user, expected", [
    # llama-server's own suite (tools/server/tests/unit/test_chat_completion.py: test_apply_chat_template,
    # test_chat_template), which starts llama-server with these names.
    ("command-r", "You are a test.", "Hi there",
     "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>"
     "Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    ("llama3", "Book", "What is the best book",
     "<|start_header_id|>system<|end_header_id|>\n\nBook<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is "
     "the best book<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
])
def test_a_built_in_template_name_renders_as_llama_server_renders_it(name, system, user, expected):
    source = chat_template(target_flags(f"--chat-template {name}"))
    assert source == BUILTIN_SOURCES[name]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    assert ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(messages) == expected


def test_a_built_in_name_duo_has_no_jinja_form_of_is_refused_naming_it_and_what_to_do():
    with pytest.raises(ValueError, match="--chat-template llama2: .*--chat-template-file"):
        chat_template(target_flags("--chat-template llama2"))


@pytest.mark.parametrize("line, variables", [
    ("", {}),  # auto: the template's enable_thinking stays llama-server's true
    ("--reasoning auto", {}),
    ("--reasoning on", {"enable_thinking": True}),
    ("-rea off", {"enable_thinking": False}),
    ("--reasoning-budget -1", {}),
    ("--reasoning-budget 0", {"enable_thinking": False}),
    ("--chat-template-kwargs {\"enable_thinking\":false,\"effort\":\"low\"}", {"enable_thinking": False,
                                                                              "effort": "low"}),
    ("--chat-template-kwargs {\"effort\":\"low\"} --reasoning off", {"effort": "low", "enable_thinking": False}),
])
def test_reasoning_flags_set_the_templates_enable_thinking(line: str, variables: dict):
    assert template_variables(target_flags(line)) == variables


@pytest.mark.parametrize("line, named", [("--reasoning-budget 512", "--reasoning-budget 512"),
                                         ("--chat-template-kwargs {\"messages\":[]}", "--chat-template-kwargs")])
def test_what_duo_cannot_honour_stops_startup_naming_the_flag(line: str, named: str, capsys):
    with pytest.raises(ValueError, match=named):
        template_options(target_flags(line))
    assert main(line.split()) == 1
    assert named in capsys.readouterr().err


def test_reasoning_takes_on_off_or_auto_only(capsys):
    with pytest.raises(SystemExit):
        target_flags("--reasoning maybe")
    assert "--reasoning" in capsys.readouterr().err


def test_a_template_file_is_checked_as_the_chat_renders_it_loop_controls_included(tmp_path):
    """Command R7B's template breaks out of a loop ({% break %}: Jinja's loopcontrols, which llama.cpp reads)."""
    template = tmp_path / "breaks.jinja"
    template.write_text("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
                        "{% endfor %}")
    source = chat_template(target_flags(f"--chat-template-file {template}"))
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert ChatTemplate(source, bos_token="", eos_token="").render(messages) == "a"



def test_variables_the_renderer_gives_itself_are_refused_from_the_launch_line():
    with pytest.raises(ValueError, match="--chat-template-kwargs may not set add_generation_prompt, messages: "):
        template_variables(target_flags('--chat-template-kwargs {"messages":[],"add_generation_prompt":true,"x":1}'))
    assert reserved_names({"enable_thinking": False, "x": 1}) == []
