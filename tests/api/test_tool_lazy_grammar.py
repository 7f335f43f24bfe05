"""tool_choice `auto` sampled as llama-server samples it: free text until the model writes its template's opening
token of a call (Qwen2.5's <tool_call>), and from it on a well-formed call of an offered function whose arguments
match its schema (llama.cpp's lazy grammar). Exact under speculation: both sides mask with the same grammar."""

from __future__ import annotations

import json

from duo.api.tools import HERMES, LLAMA3, MISTRAL, QWEN3_CODER, FunctionBody, lazy_call_grammar
from duo.constraint import checked_cursor, grammar_of
from helpers.http import client, model_name
from helpers.tools import WEATHER, token_of_in

TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}
FUNCTIONS = [FunctionBody(**WEATHER["function"]), FunctionBody(**TIME["function"])]
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


def test_the_grammar_waits_for_the_formats_opening_token_and_none_is_made_where_it_is_not_one(target_model):
    token_of = token_of_in(target_model)
    opener = token_of("<tool_call>")
    assert lazy_call_grammar(FUNCTIONS, False, HERMES, token_of).startswith(f"start: <[^{opener}]>* calls?\n")
    assert lazy_call_grammar(FUNCTIONS, False, LLAMA3, token_of) is None  # a bare JSON call has no opener
    assert lazy_call_grammar(FUNCTIONS, False, MISTRAL, lambda text: None) is None  # [TOOL_CALLS] not one token
    assert lazy_call_grammar(FUNCTIONS, False, QWEN3_CODER, token_of) is None  # its XML grammar drops optional ones


def test_text_is_free_until_the_opener_and_then_only_a_whole_valid_call_of_an_offered_function(target_model):
    token_of = token_of_in(target_model)
    cursor = checked_cursor(target_model, grammar_of("lark", lazy_call_grammar(FUNCTIONS, False, HERMES, token_of)))
    text = target_model.tokenize("Let me look that up: {\"name\": \"anything\"}\n", add_special=False)
    assert cursor.allowed().all()  # nothing is masked before a call opens, the end included
    assert cursor.move_to(text) and cursor.allowed().all()
    opened = [*text, token_of("<tool_call>")]
    assert cursor.move_to(opened) and cursor.allowed().sum() < 10
    missing_days = target_model.tokenize('\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
                                         add_special=False)
    unoffered = target_model.tokenize('\n{"name": "get_news", "arguments": {}}', add_special=False)
    whole = target_model.tokenize('\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n',
                                  add_special=False) + [token_of("</tool_call>")]
    assert cursor.valid_prefix(missing_days) < len(missing_days)
    assert cursor.valid_prefix(unoffered) < len(unoffered)
    assert cursor.valid_prefix(whole) == len(whole)
    assert cursor.move_to(opened + whole)
    allowed = cursor.allowed()
    assert set(allowed.nonzero()[0]) <= cursor.ends | set(target_model.tokenize("\n", add_special=False))


def called(process, opener: int):
    """A greedy chat with the two tools under `auto`, its call-opening token biased in (the tiny model would not
    choose it), one call at most."""
    return client(process).chat.completions.create(
        model=model_name(process), messages=ASK, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=80,
        temperature=0, parallel_tool_calls=False, logit_bias={str(opener): 100})


def test_an_opened_call_under_auto_is_a_valid_call_of_an_offered_function_alone_and_with_drafts(
        served_sync, served_alone, target_model):
    opener = token_of_in(target_model)("<tool_call>")
    for process in (served_alone, served_sync):
        response = called(process, opener)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]
        assert call.function.name in {"get_weather", "get_time"} and set(arguments) == set(schema["required"])
    assert response.model_extra["duo_stats"]["draft_tokens_accepted"] > 0


def test_a_schema_key_llguidance_does_not_implement_is_skipped_as_llama_cpp_skips_it(served_alone):
    """Claude Code's tools use `propertyNames`: llama.cpp's json-schema-to-grammar skips keys it does not know, and so
    do duo's tool grammars (llguidance's lenient mode); strict, every request with those tools was a 400."""
    env = {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"env": {"type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"},
                                                 "additionalProperties": {"type": "string"}}},
        "required": ["env"]}}}
    for choice in ("auto", "required"):
        response = client(served_alone).chat.completions.create(
            model=model_name(served_alone), messages=ASK, tools=[env], tool_choice=choice, max_tokens=24,
            temperature=0)
        assert response.choices[0].finish_reason in {"tool_calls", "length", "stop"}
