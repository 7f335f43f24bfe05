"""The forms of call Hermes-style templates' models write, read as llama.cpp's Hermes 2 Pro parser reads them: the
```json block Qwen2.5-Coder writes when left to choose, <function=NAME>{...}</function>, the bare JSON call, a call
after text, two calls, arguments as a string; the same whole and streamed however the text is cut, and served, where
the openai SDK assembles from the stream the call of the whole answer. What is no call of an offered function stays
content.

The expectations are read from llama.cpp's common/chat.cpp, common_chat_parse_hermes_2_pro (the parser of every
template holding <tool_call>, Qwen2.5's among them, until the autoparser took its place): its pattern
    (```(xml|json)?\\n\\s*)?(<tool_call>|<function_call>|<tool>|<tools>|<response>|<json>|<xml>|<JSON>)?
    (\\s*\\{\\s*"name") | <function=([^>]+)> | <function name="([^"]+)">
opens a call; the JSON after it is the call (its "arguments" an object, or a string whose text they are:
common_chat_msg_parser::add_tool_call), or, after a header, the arguments; then the spaces, the tag's close, the
fence's close and the spaces after it are passed; the text before each call is content, and so is the rest. A call
it opened that does not close makes the whole answer content. llama-server as pinned (llama-cpp-python 0.3.36, whose
autoparser reads <tool_call> alone for this template) leaves every other form as content: Qwen2.5-Coder's calls
were then never seen (issue 51).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from duo.api.output.deltas import CallArguments, CallClosed, CallOpened, TextDelta, answer_splitter, whole_answer
from duo.api.tools import GENERIC, GRANITE, HERMES, MISTRAL, FunctionBody
from helpers.http import client, model_name

WRITE_FILE = {"type": "function", "function": {
    "name": "write_file", "description": "Write a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"]}}}
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
FUNCTIONS = [FunctionBody(**WRITE_FILE["function"]), FunctionBody(**READ_FILE["function"])]

HELLO = {"path": "hello.py", "content": 'print("hello")'}
HELLO_JSON = '{"path": "hello.py", "content": "print(\\"hello\\")"}'
WRITE_HELLO = '{"name": "write_file", "arguments": ' + HELLO_JSON + '}'
READ_HELLO = '{"name": "read_file", "arguments": {"path": "hello.py"}}'

# text -> (content, [(name, arguments)]) as common_chat_parse_hermes_2_pro returns them.
CALLS: dict[str, tuple[str, list[tuple[str, Any]]]] = {
    # Qwen2.5-Coder's own, left to choose.
    f"```json\n{WRITE_HELLO}\n```": ("", [("write_file", HELLO)]),
    f"<function=write_file>{HELLO_JSON}</function>": ("", [("write_file", HELLO)]),
    f'<function name="write_file">\n{HELLO_JSON}\n</function>': ("", [("write_file", HELLO)]),
    WRITE_HELLO: ("", [("write_file", HELLO)]),
    # Text before the call is content; the pattern's \s* takes the space before a bare call into the call.
    f"I will write the file.\n```json\n{WRITE_HELLO}\n```": ("I will write the file.\n", [("write_file", HELLO)]),
    f"Here it is:\n{WRITE_HELLO}": ("Here it is:", [("write_file", HELLO)]),
    # The spaces and the line after the call: the spaces are passed, the rest is content.
    f"```json\n{WRITE_HELLO}\n```\n\nDone.": ("Done.", [("write_file", HELLO)]),
    # Two calls, each in its form; the text between them is content.
    f"```json\n{WRITE_HELLO}\n```\nThen:\n<tool_call>\n{READ_HELLO}\n</tool_call>":
        ("Then:\n", [("write_file", HELLO), ("read_file", {"path": "hello.py"})]),
    f"```json\n{WRITE_HELLO}\n```\n```json\n{READ_HELLO}\n```":
        ("", [("write_file", HELLO), ("read_file", {"path": "hello.py"})]),
    # Two calls in a fenced list: no call follows the fence (the pattern wants a brace), each object is a bare call,
    # and what stands around them is content.
    f"```json\n[{WRITE_HELLO}, {READ_HELLO}]\n```":
        ("```json\n[,]\n```", [("write_file", HELLO), ("read_file", {"path": "hello.py"})]),
    # Arguments as a string: its text is the arguments.
    '```json\n{"name": "write_file", "arguments": "{\\"path\\": \\"hello.py\\", \\"content\\": \\"x\\"}"}\n```':
        ("", [("write_file", {"path": "hello.py", "content": "x"})]),
    # The other tags, alone or inside a fence, and the fence without a language.
    f"<function_call>{WRITE_HELLO}</function_call>": ("", [("write_file", HELLO)]),
    f"<tools>\n{WRITE_HELLO}\n</tools>": ("", [("write_file", HELLO)]),
    f"<JSON>{WRITE_HELLO}</JSON>": ("", [("write_file", HELLO)]),
    f"```xml\n<tool_call>\n{WRITE_HELLO}\n</tool_call>\n```": ("", [("write_file", HELLO)]),
    f"```\n{WRITE_HELLO}\n```": ("", [("write_file", HELLO)]),
}

NOT_CALLS = [
    "```python\nprint('hello')\n```\n",  # a code block: the pattern wants JSON after the fence
    '```json\n{"path": "hello.py", "content": "x"}\n```',  # no "name" first: the pattern does not match
    "Use {} or {\"key\": 1} in JSON.",  # braces in a sentence
    # A function the request did not offer: llama.cpp's Hermes parser would call it (it checks no name), the pinned
    # llama-server answers 500; duo leaves it content, as it does in every format.
    '```json\n{"name": "delete_all", "arguments": {}}\n```',
    '<function=delete_all>{}</function>',
]


def read(deltas: list) -> tuple[str, list[tuple[str, str]]]:
    """The content and the calls (name, arguments text) that `deltas` say, each call's pieces assembled."""
    content = "".join(d.text for d in deltas if isinstance(d, TextDelta))
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if isinstance(delta, CallOpened):
            calls[delta.index] = [delta.name, ""]
        elif isinstance(delta, CallArguments):
            calls[delta.index][1] += delta.text
    closed = [(d.call.name, d.call.arguments) for d in deltas if isinstance(d, CallClosed)]
    assert closed == [tuple(call) for call in calls.values()]  # the pieces streamed are the call closed
    return content, closed


def streamed(pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    splitter = answer_splitter(FUNCTIONS, HERMES)
    return read([delta for piece in pieces for delta in splitter.feed(piece)] + splitter.finish())


def cuts(text: str) -> list[list[str]]:
    """`text` one character at a time, and in two pieces at every split point."""
    return [list(text)] + [[text[:at], text[at:]] for at in range(1, len(text))]


@pytest.mark.parametrize("text", list(CALLS), ids=lambda text: text[:24])
def test_each_form_is_read_as_llama_cpps_hermes_parser_reads_it_whole_and_streamed(text):
    content, calls = CALLS[text]
    whole = read(whole_answer(text, FUNCTIONS, HERMES))
    assert (whole[0], [(name, json.loads(arguments)) for name, arguments in whole[1]]) == (content, calls)
    for pieces in cuts(text):
        assert streamed(pieces) == whole, pieces


def test_each_form_streamed_a_token_of_qwens_at_a_time_reads_as_whole(target_model):
    for text in CALLS:
        tokens = target_model.tokenize(text, add_special=False, parse_special=False)
        pieces = [target_model.token_piece(token).decode() for token in tokens]
        assert "".join(pieces) == text and len(pieces) > 10
        whole = read(whole_answer(text, FUNCTIONS, HERMES))
        assert [name for name, _ in whole[1]] == [name for name, _ in CALLS[text][1]]
        assert streamed(pieces) == whole, pieces


@pytest.mark.parametrize("text", NOT_CALLS, ids=lambda text: text[:24])
def test_text_that_is_no_call_of_an_offered_function_stays_content_whole_and_streamed(text):
    assert read(whole_answer(text, FUNCTIONS, HERMES)) == (text, [])
    for pieces in cuts(text):
        assert streamed(pieces) == (text, []), pieces


def test_a_fenced_call_that_never_closes_makes_the_whole_answer_content():
    # common_chat_parse_hermes_2_pro's consume_literal("```") throws; common_chat_parse then reads it all as content.
    # Streamed, the call went out as it was read (deltas are not taken back), as llama-server's partial parses send it.
    text = f"```json\n{WRITE_HELLO}\n"
    assert read(whole_answer(text, FUNCTIONS, HERMES)) == (text, [])


def test_a_fenced_call_whose_json_breaks_off_into_prose_is_content_whole_and_streamed():
    """opencode's live run on the F16 1.5B target: the model closed its fence inside the call's object and went on in
    prose, whose backquote ended the arguments' bracket count only later. No client can parse those arguments
    (opencode answered "JSON parsing failed"): a call in a wrapping is held until whole and valid, so it is text."""
    text = ('To create it, use `write_file`:\n\n```json\n{"name": "write_file", "arguments": {"path": "hello.py", '
            '"content": "print(\'hello\')"\n```\n\nThis writes `hello.py` with `print(\'hello\')`.}}')
    assert read(whole_answer(text, FUNCTIONS, HERMES)) == (text, [])
    for pieces in cuts(text):
        assert streamed(pieces) == (text, []), pieces


def test_after_a_malformed_fenced_call_the_rest_of_the_answer_is_content_however_it_streams():
    """As the whole answer reads (llama.cpp's parser fails it all): a call written after it is content too, whichever
    pieces carry the fence's end and the call's opening."""
    text = f'```json\n{{"name": "write_file", "arguments": {{"path": "a",}}}}\n```\n<tool_call>\n{WRITE_HELLO}\n</tool_call>'
    assert read(whole_answer(text, FUNCTIONS, HERMES)) == (text, [])
    for pieces in cuts(text):
        assert streamed(pieces) == (text, []), pieces


def test_a_fenced_call_whose_json_breaks_early_goes_out_as_content_where_it_breaks():
    """Claude Code's second live run: the model's ```json call of its Agent tool broke at character 1,278 (a quote
    left unescaped in a string), and the client saw the answer only at its end, 113 s after its first token. A held
    call is known to be text at the first character that cannot continue its JSON: what was held goes out then, and
    the rest of the answer streams as content, as the whole answer reads."""
    head = '```json\n{"name": "write_file", "arguments": {"path": "hello.py", "content": "print("'
    rest = 'hello")"}}\n```\nThat writes it.'
    assert read(whole_answer(head + rest, FUNCTIONS, HERMES)) == (head + rest, [])
    splitter = answer_splitter(FUNCTIONS, HERMES)
    assert read(splitter.feed(head)) == ("", [])  # "print(" is a whole string: a call may still follow
    assert read(splitter.feed(rest[:1])) == (head + rest[:1], [])  # no JSON goes on with h after a string
    assert read(splitter.feed(rest[1:]) + splitter.finish()) == (rest[1:], [])


def test_a_bare_call_with_arguments_that_are_no_json_object_is_content():
    for text in ('{"name": "write_file", "arguments": {"path": "hello.py" "content": 1}}',
                 '{"name": "write_file", "arguments": "path: hello.py"}'):
        assert read(whole_answer(text, FUNCTIONS, HERMES)) == (text, [])
        for pieces in cuts(text):
            assert streamed(pieces) == (text, []), pieces


def test_content_streams_up_to_what_may_still_open_a_call_and_no_further():
    splitter = answer_splitter(FUNCTIONS, HERMES)
    assert read(splitter.feed("Writing it now. ")) == ("Writing it now.", [])  # the space may be a bare call's
    assert read(splitter.feed("``")) == (" ", [])  # a fence may be opening
    assert read(splitter.feed("`python\n")) == ("```python", [])  # no call follows a python fence
    assert read(splitter.feed("x = {")) == ("\nx =", [])  # a bare call may be opening
    assert read(splitter.feed("}")) == (" {}", [])


def gbnf_literal(text: str) -> str:
    """A GBNF grammar whose one sentence is `text`: the tiny model, under it, says `text` (duo takes a client's
    grammar beside tools where the model chooses, tool_choice auto)."""
    return "root ::= " + json.dumps(text)


SERVED = [f"I will write the file.\n```json\n{WRITE_HELLO}\n```", f"<function=write_file>{HELLO_JSON}</function>"]


@pytest.mark.parametrize("text", SERVED, ids=["json fence", "function header"])
def test_a_served_call_in_each_form_assembles_in_the_sdks_stream_into_the_whole_answers_call(served_sync, text):
    ask = {"model": model_name(served_sync), "messages": [{"role": "user", "content": "Create hello.py."}],
           "tools": [WRITE_FILE, READ_FILE], "max_tokens": 200, "temperature": 0,
           "extra_body": {"grammar": gbnf_literal(text)}}
    whole = client(served_sync).chat.completions.create(**ask)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert (choice.message.content or "") == CALLS[text][0]
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("write_file", HELLO)
    assert whole.model_extra["duo_stats"]["draft_tokens_accepted"] > 0
    with client(served_sync).chat.completions.stream(**ask) as stream:
        final = stream.get_final_completion()
    [assembled] = final.choices[0].message.tool_calls
    assert (assembled.function.name, assembled.function.arguments) == (call.function.name, call.function.arguments)
    assert (final.choices[0].message.content or "") == CALLS[text][0]


# Arguments given as a string, in the JSON formats whose llama.cpp parsers keep a string at the arguments' key as it
# is and take its text (common_chat_msg_parser::try_consume_json_with_dumped_args, then add_tool_call): Hermes'
# <tool_call>, Mistral Nemo's and Granite's lists, the generic answer.
STRING_ARGUMENTS = '"{\\"path\\": \\"hello.py\\", \\"content\\": \\"x\\"}"'
STRINGED = {
    HERMES: f'<tool_call>\n{{"name": "write_file", "arguments": {STRING_ARGUMENTS}}}\n</tool_call>',
    MISTRAL: f'[TOOL_CALLS][{{"name": "write_file", "arguments": {STRING_ARGUMENTS}, "id": "abcdefghi"}}]',
    GRANITE: f'<|tool_call|>[{{"name": "write_file", "arguments": {STRING_ARGUMENTS}}}]',
    GENERIC: f'{{"tool_call": {{"name": "write_file", "arguments": {STRING_ARGUMENTS}}}}}',
}


@pytest.mark.parametrize("format_", list(STRINGED), ids=lambda format_: format_.name)
def test_arguments_given_as_a_string_are_its_text_whole_and_streamed(format_):
    text = STRINGED[format_]
    splitter = answer_splitter(FUNCTIONS, format_)
    for deltas in (whole_answer(text, FUNCTIONS, format_),
                   [delta for piece in text for delta in splitter.feed(piece)] + splitter.finish()):
        assert read(deltas) == ("", [("write_file", '{"path": "hello.py", "content": "x"}')])


def test_a_long_run_of_spaces_in_8000_pieces_is_read_in_well_under_a_second():
    # The space before a brace may be a bare call's and is held back as it streams: held whole, 32,000 spaces in
    # 8,000 pieces were searched again at each piece (1.5 s).
    text = "a" + " " * 32_000 + "b"
    splitter = answer_splitter(FUNCTIONS, HERMES)
    start = time.process_time()
    deltas = [delta for at in range(0, len(text), 4) for delta in splitter.feed(text[at:at + 4])] + splitter.finish()
    assert time.process_time() - start < 0.5
    assert read(deltas) == (text, [])
