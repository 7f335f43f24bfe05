"""A Responses custom tool whose input follows a Lark grammar: the grammar carried over to the input's JSON-escaped
text (duo.api.tools.lark_json) and enforced wherever duo masks a call, as a regex format is; what cannot be carried
over exactly refused with a 400 naming the format; a constrained call's input, streamed and whole, one the grammar
parses, returned raw."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import lark
import llguidance
import openai
import pytest
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from duo.api.output.deltas import CallArguments, CallClosed, CallOpened
from duo.api.responses.body import ResponsesBody
from duo.api.responses.items import OutputItems
from duo.api.responses.tools import MAX_LARK_CHARS, ResponsesTools
from duo.api.responses.translate import chat_body, input_messages
from duo.api.serving.request import BadRequest
from duo.api.tools import FORMATS, GENERIC, QWEN3_CODER, FunctionBody, ToolCall, ToolError, call_grammar
from duo.api.tools.lark_json import InputGrammar, escaped_lark, json_escaped
from helpers.http import responses_events

# Codex's apply_patch grammar as codex-rs ships it (core/src/tools/handlers/tool_apply_patch.lark, the grammar Codex
# 0.171 sends with its custom apply_patch tool to the models it knows).
APPLY_PATCH_LARK = (Path(__file__).parents[1] / "data" / "agents" / "codex-tool_apply_patch.lark").read_text()
PATCH = '*** Begin Patch\n*** Add File: say "hi".py\n+print("a\\\\b")\n+\tdone = True\n*** End Patch\n'
# Rules, regex terminals and literals that hold what JSON escapes: quotes, backslashes, line breaks, tabs, unicode.
RULES = r'''
start: greeting ("," name)+ NL
greeting: "say \"hi\"" | /[a-c\\]+/
name: /[^,\n\x00]{1,4}/ | "é\t"
NL: "\n"
'''


class ByteVocabulary:
    """A vocabulary of the 256 bytes and an end: a matcher over it follows a text byte by byte."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b""]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


BYTES = LLTokenizer(TokenizerWrapper(ByteVocabulary()))


def accepts(grammar: str, text: str) -> bool:
    """Whether llguidance's Lark `grammar` takes `text` whole."""
    matcher = LLMatcher(BYTES, llguidance.grammar_from("lark", grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    data = list(text.encode())
    return matcher.try_consume_tokens(data) == len(data) and matcher.is_accepting()


def parses(grammar: str, text: str) -> bool:
    """Whether `text` is in the language of the Lark grammar, as the lark package reads it."""
    try:
        lark.Lark(grammar, parser="earley", lexer="dynamic_complete").parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


# --- the escaping -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ['say "hi"', "back\\slash", "line\nbreak\r\n", "tab\tbell\x07nul\x00",
                                  "unicode é ✓ 𝄞", "/solidus and \x7f"])
def test_the_escaping_is_json_s_one_canonical_form(text):
    assert json_escaped(text) == json.dumps(text, ensure_ascii=False)[1:-1]
    assert json.loads(f'"{json_escaped(text)}"') == text


@pytest.mark.parametrize("text, taken", [
    ('say "hi",ab\n', True), ("a\\c,x,é\t\n", True), ("b,\"\\\n", True), ("ab,\n", False), ("say hi,x\n", False),
    ("ab,toolong\n", False), ("ab,x", False), ("abd,x\n", False)])
def test_a_grammar_of_rules_and_regex_terminals_takes_the_escaped_texts_of_its_own(text, taken):
    assert parses(RULES, text) is taken
    assert accepts(escaped_lark(RULES), json_escaped(text)) is taken
    assert not accepts(escaped_lark(RULES), text) or text == json_escaped(text)  # the raw form is not the escaped one


@pytest.mark.parametrize("written", ["say \\u0022hi\\u0022,x\\n", "say \\\"hi\\\",x\\u000a",
                                     "say \\\"hi\\\",\\/\\n", "say \\\"hi\\\",\\u00e9\\t\\n"])
def test_only_the_canonical_escaping_is_taken(written):
    """JSON lets the model write a character several ways; the grammar takes json.dumps' one, so a text the grammar
    parses, written another way, is refused."""
    assert parses(RULES, json.loads(f'"{written}"')) and written != json_escaped(json.loads(f'"{written}"'))
    assert not accepts(escaped_lark(RULES), written)


def test_a_regex_terminal_followed_by_an_escaped_character_ends_where_the_raw_one_did():
    """`/(.*)/ LF`: the escaped terminal may go on with `\\"`, so a lexer that ended terminals at their longest match
    would see `\\` and be stuck when `n` came; each escaped character is its own lexeme instead."""
    grammar = 'start: /(.*)/ LF\n%import common.LF\n'
    assert accepts(escaped_lark(grammar), json_escaped('print("a\\\\b")\n'))


@pytest.mark.parametrize("grammar, text, taken, raw_taken", [
    ('start: /[a-z]*x/', "abx", True, True), ('start: /[a-z]*/ "x"', "abx", False, False),
    ('start: /[a-z]*/ "1"', "ab1", True, True), ('start: /[a-z"]+/ "\\""', 'a"b"', True, False)])
def test_a_terminals_language_is_exact_and_a_repeat_ending_it_runs_as_llguidance_runs_the_raw_one(grammar, text, taken,
                                                                                                   raw_taken):
    """Within a terminal, its regex's language; where it ends, a repeated class takes what it writes as it is as far
    as it goes, as llguidance's lexer takes the raw terminal (OpenAI's servers enforce custom tools' grammars with it):
    /[a-z]*/ leaves no x. An escape is a lexeme of its own, so a quote may end the terminal or follow it: a text the
    raw lexer, having taken the last quote, is stuck on is taken (it is in the grammar's language)."""
    assert accepts(escaped_lark(grammar), json_escaped(text)) is taken
    assert accepts(grammar, text) is raw_taken


def test_ignored_terminals_stand_between_terminals_and_at_the_end_only():
    grammar = 'start: WORD+\nWORD: /[a-z]+/\n%import common.WS\n%ignore WS\n'
    escaped = escaped_lark(grammar)
    assert accepts(escaped, json_escaped(" ab\tcd \n")) and accepts(escaped, "ab")
    assert not accepts(escaped, json_escaped("ab1"))


# --- Codex's apply_patch grammar ---------------------------------------------------------------------------------------


def test_codexs_apply_patch_grammar_is_carried_over_exactly():
    """The lark package's Earley parser refuses the grammar (its /(.*)/ may match nothing): llguidance, which OpenAI's
    servers enforce it with, reads the raw grammar over the raw patch as the reference."""
    escaped = escaped_lark(APPLY_PATCH_LARK)
    update = '*** Begin Patch\n*** Update File: a.py\n@@ def f():\n-    return "x"\n+    return "y"\n*** End Patch'
    for patch in (PATCH, update):
        assert accepts(APPLY_PATCH_LARK, patch) and accepts(escaped, json_escaped(patch))
    for broken in (PATCH.replace("+print", "print"), PATCH.replace("*** End Patch\n", ""), "*** Begin Patch\n"):
        assert not accepts(APPLY_PATCH_LARK, broken) and not accepts(escaped, json_escaped(broken))


def custom_lark_tool(name: str = "apply_patch", definition: str = APPLY_PATCH_LARK) -> dict:
    return {"type": "custom", "name": name, "description": "Edit files with a patch.",
            "format": {"type": "grammar", "syntax": "lark", "definition": definition}}


def chat_functions(tools: list[dict], choice: object = "required") -> list[FunctionBody]:
    body = ResponsesBody.model_validate({"input": "hi", "tools": tools, "tool_choice": choice})
    body.check_supported()
    return chat_body(body, input_messages(body), ResponsesTools(body.tools)).to_request().tool_use.callable


@pytest.mark.parametrize("format_", [f for f in (*FORMATS, GENERIC) if f is not QWEN3_CODER], ids=lambda f: f.name)
def test_every_call_format_writes_a_custom_tools_call_with_its_input_under_the_grammar(format_):
    closed = {"type": "function", "name": "done", "parameters": {"type": "object", "properties": {},
                                                                  "additionalProperties": False}}
    functions = chat_functions([custom_lark_tool(), closed])
    assert functions[0].input_grammar and functions[1].input_grammar is None
    grammar = call_grammar(functions, False, format_, lambda markup: None)
    assert "%lark {" in grammar and not LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar))


def test_a_hermes_call_of_the_custom_tool_is_taken_only_with_an_input_the_grammar_parses():
    [function] = chat_functions([custom_lark_tool()], {"type": "custom", "name": "apply_patch"})
    grammar = call_grammar([function], False, next(f for f in FORMATS if f.name.startswith("Qwen2.5")),
                           lambda markup: None)

    def call(text: str) -> str:
        return f'<tool_call>\n{{"name": "apply_patch", "arguments": {json.dumps({"input": text}, ensure_ascii=False)}}}' \
               '\n</tool_call>'
    assert accepts(grammar, call(PATCH)) and accepts(APPLY_PATCH_LARK, PATCH)
    assert not accepts(grammar, call(PATCH.replace("+print", "print")))


def test_qwen3_coders_raw_string_arguments_cannot_hold_a_lark_input_and_say_so():
    [function] = chat_functions([custom_lark_tool()])
    with pytest.raises(ToolError) as raised:
        call_grammar([function], False, QWEN3_CODER, lambda markup: None)
    assert raised.value.param == "tools[0].format"


# --- what cannot be carried over exactly ---------------------------------------------------------------------------


@pytest.mark.parametrize("definition, named", [
    ('start: /(?=a)[a-z]/', "assert"), (r'start: /(a)\1/', "groupref"), ("start: A\nA: /^a/", "at in a regex"),
    ("start: /a++/", "possessive"), ("%import os.path (X)\nstart: X", "%import os.path"),
    ("%declare X\nstart: X", "%declare"), ('start: %json {"type": "integer"}', "not a Lark grammar"),
    ('start: "select"i', "flag"), ('start: A\nA.2: "a"', "priorities"), ("start: b\nb.2: \"a\"", "priorities"),
    ("start: /(?i:a)b/", "inline flags"), ("start: undefined_rule", "not a Lark grammar"),
    ('start: <[15]>', "not a Lark grammar")])
def test_what_cannot_be_enforced_exactly_is_refused_naming_the_format(definition, named):
    for tools, param in [([custom_lark_tool(definition=definition)], "tools[0].format"),
                         ([{"type": "namespace", "name": "edit", "description": "d",
                            "tools": [custom_lark_tool(definition=definition)]}], "tools[0].tools[0].format")]:
        body = ResponsesBody.model_validate({"input": "hi", "tools": tools})
        body.check_supported()
        with pytest.raises(BadRequest) as raised:
            ResponsesTools(body.tools)
        assert raised.value.param == param and named in str(raised.value), str(raised.value)


def test_a_requests_lark_grammars_are_bounded_in_size_together():
    """Reading a grammar is pure Python (68k characters of rules: 2 s on a loaded core): past MAX_LARK_CHARS together,
    the one that crosses the bound is refused by name."""
    half = 'start: "a"\n' + "// a comment line\n" * (MAX_LARK_CHARS // 2 // 18)
    body = ResponsesBody.model_validate({"input": "hi", "tools": [custom_lark_tool("a", half),
                                                                  custom_lark_tool("b", half + half)]})
    with pytest.raises(BadRequest) as raised:
        ResponsesTools(body.tools)
    assert raised.value.param == "tools[1].format" and str(MAX_LARK_CHARS) in str(raised.value)
    assert ResponsesTools(body.tools[:1]).input_grammars["a"].source_chars == len(half)


def test_lark_templates_are_expanded_and_enforced():
    grammar = 'start: pair{"a", "b"}\n_separated{x, sep}: x (sep x)*\npair{k, v}: k "=" v\n'
    assert accepts(escaped_lark(grammar), "a=b") and not accepts(escaped_lark(grammar), "a=a")


# --- served ------------------------------------------------------------------------------------------------------------

# A grammar a tiny model's call ends under (bounded terminals), whose texts hold quotes, backslashes and line breaks.
BOUNDED = r'''
start: "*** Begin Patch\n" "*** Add File: " NAME "\n" line line? "*** End Patch\n"
line: "+" TEXT "\n"
NAME: /[a-z]{1,6}\.py/
TEXT: /[a-z"\\ \t]{1,6}/
'''


def test_a_forced_custom_tool_call_is_answered_with_an_input_its_grammar_parses(served_sync):
    body = {"input": "Write a file.", "tools": [custom_lark_tool("write", BOUNDED)],
            "tool_choice": {"type": "custom", "name": "write"}, "max_output_tokens": 120, "temperature": 0}
    response = httpx.post(f"{served_sync.http_url}/v1/responses", json=body, timeout=120)
    assert response.status_code == 200, response.text
    [call] = [item for item in response.json()["output"] if item["type"] == "custom_tool_call"]
    assert call["name"] == "write" and parses(BOUNDED, call["input"]), call["input"]
    assert response.json()["status"] == "completed"


def test_the_openai_sdk_reads_the_same_grammatical_input_whole_and_streamed(served_sync):
    api = openai.OpenAI(base_url=f"{served_sync.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    fields = {"model": "tiny", "input": "Write a file.", "tools": [custom_lark_tool("write", BOUNDED)],
              "tool_choice": "required", "max_output_tokens": 120, "temperature": 0}
    whole = api.responses.create(**fields)
    with api.responses.stream(**fields) as stream:
        streamed = stream.get_final_response()
    [call], [same] = ([item for item in response.output if item.type == "custom_tool_call"]
                      for response in (whole, streamed))
    assert call.input == same.input and parses(BOUNDED, call.input), call.input


def test_codexs_apply_patch_grammar_constrains_a_served_call(served_sync):
    """The tiny model's patch may run past its token limit (a filename is any line): what it wrote is then a start
    the grammar can finish; whole, the grammar parses it."""
    body = {"input": "Create hello.py.", "tools": [custom_lark_tool()], "stream": True,
            "tool_choice": {"type": "custom", "name": "apply_patch"}, "max_output_tokens": 80, "temperature": 0}
    events = responses_events(served_sync, body)
    final = events[-1]["response"]
    [call] = [item for item in final["output"] if item["type"] == "custom_tool_call"]
    assert call["input"].startswith("*** Begin Patch\n*** ")
    if final["status"] == "completed":
        assert accepts(APPLY_PATCH_LARK, call["input"]), call["input"]
    else:
        matcher = LLMatcher(BYTES, llguidance.grammar_from("lark", APPLY_PATCH_LARK), log_level=0)
        data = list(call["input"].encode())
        assert matcher.try_consume_tokens(data) == len(data), call["input"]


def test_an_input_grammar_is_refused_over_http_naming_the_format(served_sync):
    body = {"input": "hi", "tools": [custom_lark_tool(definition="start: /(a)\\1/")]}
    response = httpx.post(f"{served_sync.http_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools[0].format"


def test_the_input_grammar_is_private_to_duo():
    """No chat body can set it: a client's function is served as llama-server serves it."""
    function = FunctionBody.model_validate({"name": "f", "input_grammar": {"key": "input", "lark": "start: \"x\""},
                                            "_input_grammar": "x"})
    assert function.input_grammar is None
    function.constrain_input(InputGrammar("input", 'start: "x"', "tools[0].format"))
    assert "input_grammar" not in function.model_dump()


@pytest.mark.parametrize("arguments, written", [('{"input": "*** Begin Patch\\n*** Add', "*** Begin Patch\n*** Add"),
                                                ('{"input": "say \\"hi\\u00', 'say "hi'), ('{"input": "x\\', "x"),
                                                ('{"input": "x"', "x")])
def test_a_call_cut_inside_its_input_returns_the_input_written_so_far(arguments, written):
    """A constrained call cut by the token limit: its custom_tool_call's input is the raw text the model wrote, not
    the JSON it was writing it in."""
    items = OutputItems(ResponsesTools(ResponsesBody.model_validate({"input": "hi",
                                                                     "tools": [custom_lark_tool()]}).tools))
    call = ToolCall("call_1", "apply_patch", arguments)
    items.feed([CallOpened(0, call.id, call.name), CallArguments(0, arguments), CallClosed(0, call)])
    assert items.items[0]["input"] == written
