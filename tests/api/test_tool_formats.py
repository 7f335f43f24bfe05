"""Every call format llama-server's chat layer parses: told from its template, its calls split out of the model's
text however it streams (streamed deltas assemble to the whole answer's calls), a required call written by the
grammar so that it parses, and the chunks that clients' stream readers (Continue, LlamaIndex) assemble whole."""

from __future__ import annotations

import json

import pytest

from duo.api.openai.answers import ChatFormat
from duo.api.output.deltas import CallArguments, CallClosed, CallOpened, ReasoningDelta, TextDelta, answer_splitter, whole_answer
from duo.api.output.deltas import Reasoning
from duo.api.serving.chat_tokens import answer_text, marker_tokens
from duo.api.tools import (COMMAND_R7B, DEEPSEEK_R1, DEEPSEEK_V3_1, FIREFUNCTION_V2, FUNCTIONARY_V3_1, FUNCTIONARY_V3_2,
                           GENERIC, GPT_OSS, GRANITE, HERMES, KIMI_K2, LLAMA3, MISTRAL, QWEN3_CODER, FunctionBody,
                           call_format)
from helpers.tools import WEATHER as BOUNDED, required_text

WEATHER = FunctionBody(name="get_weather", parameters={
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]})
FUNCTIONS = [WEATHER, FunctionBody(name="get_time")]
ARGS = {"city": "Paris", "days": 3}
# Each family's answer as its template asks for it (llama.cpp's common/chat.cpp parsers and tests/test-chat.cpp).
ANSWERS = {
    HERMES: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    QWEN3_CODER: ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                  "</parameter>\n</function>\n</tool_call>"),
    MISTRAL: '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, "id": "abcdefghi"}]',
    LLAMA3: '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    DEEPSEEK_R1: ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                  '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    DEEPSEEK_V3_1: ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    FUNCTIONARY_V3_1: '<function=get_weather>{"city": "Paris", "days": 3}</function>',
    FUNCTIONARY_V3_2: '>>>get_weather\n{"city": "Paris", "days": 3}',
    COMMAND_R7B: ('<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", '
                  '"parameters": {"city": "Paris", "days": 3}}\n]<|END_ACTION|>'),
    GRANITE: '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    GPT_OSS: ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
              '{"city": "Paris", "days": 3}<|call|>'),
    KIMI_K2: ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
              '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>'),
    FIREFUNCTION_V2: ' functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    GENERIC: '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}',
}


def streamed(text: str, format_, size: int, **kwargs) -> list:
    splitter = answer_splitter(FUNCTIONS, format_, **kwargs)
    return [d for at in range(0, len(text), size) for d in splitter.feed(text[at:at + size])] + splitter.finish()


@pytest.mark.parametrize("format_", list(ANSWERS), ids=lambda f: f.name)
def test_each_formats_call_is_parsed_however_it_streams(format_):
    text = "I will look.\n" + ANSWERS[format_] if not format_.at_start else ANSWERS[format_]
    whole = whole_answer(text, FUNCTIONS, format_)
    [call] = [d.call for d in whole if isinstance(d, CallClosed)]
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGS
    for size in (1, 2, 3, 5, 8, 13, len(text)):
        deltas = streamed(text, format_, size)
        opened = [d for d in deltas if isinstance(d, CallOpened)]
        arguments = "".join(d.text for d in deltas if isinstance(d, CallArguments))
        assert [d.name for d in opened] == ["get_weather"] and json.loads(arguments) == ARGS, size
        assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == \
            "".join(d.text for d in whole if isinstance(d, TextDelta))


def test_a_qwen3_coder_string_parameter_streams_as_a_json_string_in_pieces():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan \"Fran\"\ncisco\n</parameter>\n"
    pieces = [d.text for d in streamed(text, QWEN3_CODER, 1) if isinstance(d, CallArguments)]
    assert len(pieces) > 5 and "".join(pieces) == '{"city": "San \\"Fran\\"\\ncisco"'  # no close yet: still open


def test_the_generic_formats_reply_is_content_as_it_streams():
    text = '{"response": "Hello \\"you\\" \\u00e9"}'
    for size in (1, 4, 7, len(text)):
        deltas = streamed(text, GENERIC, size)
        assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == 'Hello "you" é'


# The markers llama.cpp's common_chat_templates_apply_jinja tells each family by, as each family's template holds
# them (llama.cpp models/templates: Qwen3-Coder, DeepSeek R1 distills, DeepSeek-V3.1, Command R7B tool_use, Granite
# 3.3, GPT-OSS, Kimi K2, Functionary medium v3.1 / v3.2, Firefunction v2, Llama 3.1, Mistral Nemo, Hermes 3).
TEMPLATES = {
    QWEN3_CODER: '{{- "<tool_call>\\n<function>\\n<name>" }}<parameters><function=x><parameter=y>',
    HERMES: "<tools>{{ tool | tojson }}</tools> <tool_call>",
    DEEPSEEK_R1: "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}}",
    DEEPSEEK_V3_1: ("{%- if message['prefix'] is defined and message['prefix'] and thinking %}<｜tool▁calls▁begin｜>"),
    COMMAND_R7B: "{{ '<|END_THINKING|><|START_ACTION|>' }}",
    GRANITE: "{%- elif thinking %}<|tool_call|>",
    GPT_OSS: "<|start|>assistant<|channel|>final<|message|>",
    KIMI_K2: "<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|tool_calls_section_begin|>",
    FUNCTIONARY_V3_2: "{{ '>>>all\\n' + message['content'] }}",
    FIREFUNCTION_V2: "{{ ' functools[' + calls + ']' }}",
    FUNCTIONARY_V3_1: "<|start_header_id|>{{ role }}<|end_header_id|><function={{ name }}>",
    LLAMA3: "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}<|python_tag|>",
    MISTRAL: "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]",
    GENERIC: "{% for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}<|im_end|>{% endfor %}",
}


@pytest.mark.parametrize("format_", list(TEMPLATES), ids=lambda f: f.name)
def test_the_format_is_told_from_the_template_as_llama_cpp_tells_it(format_):
    assert call_format(TEMPLATES[format_]) is format_


def test_reasoning_is_split_from_the_answer_whole_and_streamed():
    text = "<think>\nThe user wants a greeting.\n</think>\n\nHello!"
    for size in (1, 3, len(text)):
        deltas = streamed(text, None, size)
        assert "".join(d.text for d in deltas if isinstance(d, ReasoningDelta)) == "The user wants a greeting."
        assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == "Hello!"


def test_a_prompt_that_opened_the_reasoning_makes_the_answer_start_inside_it():
    deltas = whole_answer("thinking...</think>Hi", None, None, Reasoning(opened=True))
    assert deltas == [ReasoningDelta("thinking..."), TextDelta("Hi")]
    assert whole_answer("<think>x</think>Hi", None, None, Reasoning("none")) == [TextDelta("<think>x</think>Hi")]


def chunks(format_, text: str, size: int = 3) -> list[dict]:
    chat = ChatFormat("m", FUNCTIONS, format_)
    out = []
    for at in range(0, len(text), size):
        last = at + size >= len(text)
        out += chat.chunk_choices(text[at:at + size], "stop" if last else None)
    return [choice["delta"] for choice in out]


def continue_reader(deltas: list[dict]) -> dict[int, dict]:
    """Continue's reading (continuedev/continue core/llm/openaiTypeConverters.ts, fromChatCompletionChunk): a delta
    with content is content alone, its tool calls dropped; else its first tool call is taken."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        if delta.get("content"):
            continue
        for call in (delta.get("tool_calls") or [])[:1]:
            entry = calls.setdefault(len(calls) if call.get("id") else max(calls), {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name") or ""
            entry["arguments"] += call["function"].get("arguments") or ""
    return calls


def llamaindex_reader(deltas: list[dict]) -> dict[int, dict]:
    """LlamaIndex's (llama_index/llms/openai/base.py, _stream_chat): only a delta's first tool call is read, its
    pieces added to the call of the same index."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        for call in (delta.get("tool_calls") or [])[:1]:
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name") or ""
            entry["arguments"] += call["function"].get("arguments") or ""
    return calls


@pytest.mark.parametrize("reader", [continue_reader, llamaindex_reader], ids=["Continue", "LlamaIndex"])
def test_clients_stream_readers_get_every_call(reader):
    text = "Looking.\n" + ANSWERS[HERMES] + "\n" + ANSWERS[HERMES].replace("Paris", "Rome")
    deltas = chunks(HERMES, text)
    assert all(len(delta) == 1 for delta in deltas if delta)  # content, reasoning or one call: never two
    calls = reader(deltas)
    assert [(c["name"], json.loads(c["arguments"])["city"]) for c in calls.values()] == [
        ("get_weather", "Paris"), ("get_weather", "Rome")]


@pytest.mark.parametrize("format_", [f for f in ANSWERS if f not in (GENERIC,)], ids=lambda f: f.name)
def test_a_required_call_in_each_format_is_written_so_that_it_parses(target_model, format_):
    """The grammar and the parser agree: the tiny target, forced by the grammar, writes a call the parser reads."""
    text = required_text(target_model, format_, [FunctionBody(**BOUNDED["function"])])
    [call] = [d.call for d in whole_answer(text, [WEATHER], format_) if isinstance(d, CallClosed)]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "days"}, text


def test_an_answers_text_spells_out_the_control_tokens_of_its_formats_markup_and_no_other(target_model):
    im_start = target_model.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert len(im_start) == 1 and target_model.token_piece(im_start[0]) == b""  # a control token, unrendered
    preserved = marker_tokens(target_model, ["<|im_start|>assistant", "</tool_call>"])
    assert preserved == frozenset(im_start)  # </tool_call> is text already: nothing to preserve
    hi = target_model.tokenize("hi", add_special=False, parse_special=False)
    end = target_model.vocab().eos
    assert answer_text(target_model, im_start + hi + [end], preserved) == b"<|im_start|>hi"
    assert answer_text(target_model, im_start + hi + [end], frozenset()) == b"hi"
