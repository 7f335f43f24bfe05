"""Streamed tool calls are read once, however the text is cut: every format's calls split into the same deltas fed
whole, a character at a time or in random pieces, cut off anywhere; and a call whose head or tail is long (as a
client's grammar beside tools may make it) costs time in proportion to its text, not to its square."""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace
from typing import Any

import pytest

from duo.api.output.deltas import CallArguments, CallClosed, CallOpened, Delta, TextDelta
from duo.api.tools import (COMMAND_R7B, DEEPSEEK_R1, DEEPSEEK_V3_1, FIREFUNCTION_V2, FORMATS, FUNCTIONARY_V3_1,
                           FUNCTIONARY_V3_2, GENERIC, GPT_OSS, GRANITE, HERMES, KIMI_K2, LLAMA3, MISTRAL, QWEN3_CODER,
                           CallFormat, FunctionBody)
from duo.api.output.calls.splitter import CallSplitter
from duo.api.output.json_check import JsonCheck

FUNCTIONS = [FunctionBody(name="get_weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "where": {"type": "object"}}}),
             FunctionBody(name="get_time")]
# Arguments as a model may write them: plain, with what a scanner must not be fooled by (brackets and quotes inside
# strings, escapes, nesting, space), empty, and what is no JSON at all (Python's dict, a bare word).
ARGUMENTS = ['{"city": "Paris", "days": 3}',
             '{"city": "a \\"b\\" {c} [d] \\\\ \\u00e9", "where": {"x": [1, {"y": null}], "z": "}"}}',
             '{ }', "{\n  \"city\" :\n  \"Rome\"\n}", "{'city': 'Paris'}", "True"]


def xml_arguments(arguments: str) -> str:
    """Qwen3-Coder's parameters for the JSON `arguments` (none where they are no JSON object)."""
    try:
        values = json.loads(arguments)
    except ValueError:
        return "<parameter=city>\nParis"  # cut inside its value: no call
    return "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
                   for key, value in values.items())


def written(format_: CallFormat, calls: list[tuple[str, str]]) -> str:
    """`calls` (name, arguments) as the format's template asks the model to write them."""
    each = {
        HERMES: lambda n, a: f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>\n',
        QWEN3_CODER: lambda n, a: f"<tool_call>\n<function={n}>\n{xml_arguments(a)}</function>\n</tool_call>\n",
        FUNCTIONARY_V3_1: lambda n, a: f"<function={n}>{a}</function>",
        FUNCTIONARY_V3_2: lambda n, a: f">>>{n}\n{a}",
        GPT_OSS: lambda n, a: (f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json"
                               f"<|message|>{a}<|call|>"),
        LLAMA3: lambda n, a: f'<|python_tag|>{{"name": "{n}", "parameters": {a}}}',
    }
    if format_ in each:
        return "".join(each[format_](name, arguments) for name, arguments in calls)
    sections = {
        DEEPSEEK_R1: lambda n, a: f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{a}\n```<｜tool▁call▁end｜>",
        DEEPSEEK_V3_1: lambda n, a: f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{a}<｜tool▁call▁end｜>",
        KIMI_K2: lambda n, a: f"<|tool_call_begin|>functions.{n}:0<|tool_call_argument_begin|>{a}<|tool_call_end|>",
    }
    if format_ in sections:
        return (format_.section + "".join(sections[format_](name, arguments) for name, arguments in calls)
                + format_.section_end)
    listed = {
        MISTRAL: lambda n, a: f'{{"name": "{n}", "arguments": {a}, "id": "abcdefghi"}}',
        COMMAND_R7B: lambda n, a: f'{{"tool_call_id": "0", "tool_name": "{n}", "parameters": {a}}}',
        GRANITE: lambda n, a: f'{{"name": "{n}", "arguments": {a}}}',
        FIREFUNCTION_V2: lambda n, a: f'{{"name": "{n}", "arguments": {a}}}',
        GENERIC: lambda n, a: f'{{"name": "{n}", "arguments": {a}}}',
    }
    items = [listed[format_](name, arguments) for name, arguments in calls]
    if format_ is GENERIC:
        return f'{{"tool_call": {items[0]}}}' if len(items) == 1 else f'{{"tool_calls": [{", ".join(items)}]}}'
    return f"{format_.section}[{', '.join(items)}]{format_.section_end}"


def corpus(format_: CallFormat) -> list[str]:
    """Answers in `format_`: one call and two, each with every kind of arguments, a function not offered, keys
    around the name and after the arguments, and content around the calls where the format lets it stand."""
    calls = [[("get_weather", arguments)] for arguments in ARGUMENTS]
    calls += [[("get_weather", ARGUMENTS[0]), ("get_time", "{}")], [("send_mail", "{}")]]
    texts = [written(format_, one) for one in calls]
    if format_.naming in ("json", "generic"):  # keys duo skips: before the name, and after the arguments
        texts.append(texts[0].replace('"name"', '"id": "x{y}", "name"', 1).replace(', "id": "abcdefghi"', ""))
        texts.append(texts[0].replace("3}", '3}, "extra": [1, "]"] ', 1))
        texts.append(texts[0].replace('"name": "get_weather", ', "", 1).replace("3}", '3}, "name": "get_weather"', 1))
    if format_ is GENERIC:
        texts.append('{"response": "Hello \\"you\\" \\u00e9\\n"}')
    if format_.at_start:
        return texts + [" \n" + text for text in texts] + ["The weather {is} fine", "{not a call"]
    return texts + [f"I will look.\n{text}\nDone." for text in texts] + ["a < b and <tool_ is no call"]


def deltas(format_: CallFormat, pieces: list[str]) -> list[Delta]:
    """The deltas of an answer fed in `pieces`, call ids numbered in order (they are random)."""
    splitter = CallSplitter(FUNCTIONS, format_)
    out = [delta for piece in pieces for delta in splitter.feed(piece)] + splitter.finish()
    return [CallOpened(d.index, str(d.index), d.name) if isinstance(d, CallOpened) else
            CallClosed(d.index, replace(d.call, id=str(d.index))) if isinstance(d, CallClosed) else d for d in out]


def merged(deltas: list[Delta]) -> list[Delta]:
    """`deltas` with the pieces of one text and of one call's arguments joined: what a client assembles."""
    out: list[Delta] = []
    for delta in deltas:
        last = out[-1] if out else None
        if isinstance(delta, TextDelta) and isinstance(last, TextDelta):
            out[-1] = TextDelta(last.text + delta.text)
        elif isinstance(delta, CallArguments) and isinstance(last, CallArguments) and last.index == delta.index:
            out[-1] = CallArguments(delta.index, last.text + delta.text)
        else:
            out.append(delta)
    return out


def cut(text: str, rng: random.Random) -> list[str]:
    """`text` in pieces of random length, 1 to 8 characters."""
    pieces, at = [], 0
    while at < len(text):
        size = rng.randint(1, 8)
        pieces.append(text[at:at + size])
        at += size
    return pieces


def content_words(deltas: list[Delta]) -> list[str]:
    """The content, less the line breaks around calls that the format's layout drops (as they fall in pieces)."""
    return "".join(d.text for d in deltas if isinstance(d, TextDelta)).split()


def calls_of(deltas: list[Delta]) -> list[Delta]:
    return [d for d in merged(deltas) if not isinstance(d, TextDelta)]


@pytest.mark.parametrize("format_", [*FORMATS, GENERIC], ids=lambda f: f.name)
def test_each_formats_calls_split_the_same_whole_a_character_at_a_time_and_in_random_pieces(format_):
    rng = random.Random(format_.name)
    for text in corpus(format_):
        whole = deltas(format_, [text])
        for pieces in (list(text), cut(text, rng), cut(text, rng)):
            streamed = deltas(format_, pieces)
            assert calls_of(streamed) == calls_of(whole), (text, pieces)
            assert content_words(streamed) == content_words(whole), (text, pieces)


@pytest.mark.parametrize("format_", [*FORMATS, GENERIC], ids=lambda f: f.name)
def test_each_formats_answer_cut_off_anywhere_splits_the_same_whole_and_in_pieces(format_):
    rng = random.Random(format_.name)
    for text in corpus(format_)[:len(ARGUMENTS) + 2]:
        for end in range(1, len(text)):
            whole = deltas(format_, [text[:end]])
            streamed = deltas(format_, cut(text[:end], rng))
            assert calls_of(streamed) == calls_of(whole), text[:end]
            assert content_words(streamed) == content_words(whole), text[:end]


def seconds_to_stream(format_: CallFormat, text: str, size: int = 4) -> float:
    """The CPU time the splitter takes over `text` fed `size` characters at a time."""
    splitter = CallSplitter(FUNCTIONS, format_)
    start = time.process_time()
    for at in range(0, len(text), size):
        splitter.feed(text[at:at + size])
    splitter.finish()
    return time.process_time() - start


LONG = 32_000  # 8,000 four-character pieces


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"arguments": {"city": "' + "x" * LONG + '"}, "name": "get_weather"}</tool_call>',
    '<tool_call>\n{"id": "' + "x" * LONG + '", "name": "get_weather", "arguments": {"city": "P"}}</tool_call>',
    '<tool_call>\n{' + '"k": 0, ' * (LONG // 8) + '"name": "get_weather", "arguments": {}}</tool_call>',
    '<tool_call>\n{' + " " * LONG + '"name": "get_weather", "arguments": {}}</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {}, "id": "' + "x" * LONG + '"}</tool_call>',
], ids=["arguments before the name", "a long id before the name", "many keys before the name",
        "space before the name", "a long key after the arguments"])
def test_a_long_call_head_or_tail_in_8000_pieces_is_read_in_well_under_a_second(text):
    # Read again from its start at each piece, such a head took 6.4 s of the event loop (issue 49).
    assert seconds_to_stream(HERMES, text) < 0.5


def test_a_long_qwen3_coder_value_read_whole_is_searched_for_its_end_once():
    text = "<tool_call>\n<function=get_weather>\n<parameter=where>\n[" + "1, " * (LONG // 3) + "1]\n</parameter>\n"
    assert seconds_to_stream(QWEN3_CODER, text, size=1) < 0.5


def json_value(rng: random.Random, depth: int = 0) -> Any:
    if depth > 3 or rng.random() < 0.3:
        return rng.choice([0, -2.5, 1e-7, 12345678901234567890, True, False, None, 'a "quoted"\\ \n é 😀', ""])
    if rng.random() < 0.5:
        return [json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": json_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def scanned(text: str, rng: random.Random) -> tuple[int, bool] | None:
    """What JsonCheck says of `text` fed in random pieces: how much of it is the value and whether the value ended
    there (None: broken, no JSON value goes on so)."""
    scan, at = JsonCheck(), 0
    while at < len(text):
        used, done = scan.feed(text[at:at + rng.randint(1, 6)])
        at += used
        if scan.broken:
            return None
        if done:
            return at, True
    return at, False


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_json_values_in_any_pieces_end_where_their_json_ends():
    rng = random.Random(7)
    for _ in range(2000):
        value = json_value(rng)
        if not isinstance(value, (dict, list, str)):
            continue  # a number or literal ends only where something follows it
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        assert scanned(text + ' , "next"', rng) == (len(text), True), text


def test_json_that_cannot_go_on_is_no_call_at_the_character_that_breaks_it():
    """One character put anywhere into a JSON object or array: where json.loads reads the result, JsonCheck ends the
    value where it ends; where it does not, JsonCheck says it broke, or it is still unfinished, or what it took before
    the character is a whole value json.loads reads: never a value json.loads would refuse."""
    rng = random.Random(11)
    refused = 0
    for _ in range(4000):
        value = json_value(rng)
        if not isinstance(value, (dict, list)):
            continue
        text = json.dumps(value)
        at = rng.randrange(len(text) + 1)
        broken = text[:at] + rng.choice('",:{}[] a1\\e-.') + text[at:]
        if not is_json(broken):
            seen = scanned(broken, rng)
            refused += seen is None
            if seen is not None and seen[1]:  # what it took is a whole value (a character after it is not its)
                assert is_json(broken[:seen[0]]), broken
        else:
            assert scanned(broken, rng) == (len(broken.rstrip()), True), broken
    assert refused > 1000
    for text in ('{"a": 1 "b": 2}', '{"a": "x"y"}', '[1, 2,]', '{"a": 01}', '{"a": tru}', '{"a": "\\q"}',
                 '{"a": "line\nbreak"}', '{"a": NaN}', '{,}', '{"a":\u00a01}'):
        assert scanned(text, rng) is None, text
