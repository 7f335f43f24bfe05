"""Grammars that make the model call a tool in its template's own format: for tool_choice `required` or a named
function, and for the generic JSON format (whose every answer is written under one)."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Sequence

from duo.api.tools.formats import CallFormat
from duo.api.tools.lark_json import InputGrammar
from duo.api.tools.messages import FunctionBody, ToolError
from duo.constraint import JSON_OPTIONS

# Tool schemas as llama.cpp reads them: its json-schema-to-grammar skips keys it does not know (Claude Code's tools
# use `propertyNames`), where llguidance refuses them outside its lenient mode.
TOOL_JSON_OPTIONS = {**JSON_OPTIONS, "lenient": True}

# The markup that may be one token of the model's (its control tokens): written by id where it is.
MARKUP = re.compile(r"(<\|[^|<>]*\|>|<｜[^｜<>]*｜>|\[TOOL_CALLS\]|</?tool_call>)")
ANY_OBJECT = {"type": "object"}


def call_grammar(functions: Sequence[FunctionBody], parallel: bool, format_: CallFormat,
                 token_of: Callable[[str], int | None], required: bool = True) -> str:
    """A Lark grammar whose every answer is one call (several with `parallel`, where the format can say so) of one
    of `functions` in the model's format, its arguments matching the function's parameters. `token_of(text)`: the
    id of the model's token for markup that is one token (<tool_call>, [TOOL_CALLS]), named in the grammar as the
    model writes it; else None (then it is text). `required` False (the generic format only) lets the answer be a
    reply instead."""
    def text(markup: str) -> str:
        return " ".join(_piece(piece, token_of) for piece in MARKUP.split(markup) if piece) or '""'

    freeform = any(function.input_grammar for function in functions)
    if format_.naming == "generic":
        if freeform:
            return f"start: {_generic_calls(functions, parallel, required)}\n"
        return f"start: %json {json.dumps(_generic_schema(functions, parallel, required))}\n"
    if format_.naming == "json" and (format_.listed or format_.at_start):
        call = _envelopes(functions, format_)
        if format_.at_start:
            return f"start: {_call_object(functions, format_)}\n" if freeform else f"start: %json {json.dumps(call)}\n"
        calls = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1}),
                 "x-guidance": TOOL_JSON_OPTIONS}
        listed = _listed(_call_object(functions, format_), parallel) if freeform else f"%json {json.dumps(calls)}"
        return f'start: {text(format_.section)} " "? {listed} {text(format_.section_end)}\n'
    return (f'start: {text(format_.section)} call{"+" if parallel else ""} {text(format_.section_end)}\n'
            f"call: {' | '.join(f'call_{i}' for i in range(len(functions)))}\n"
            + "".join(f"call_{i}: {text(format_.call_open)} {_called(function, format_, text, freeform)} "
                      f"{text(format_.call_close)} \"\\n\"?\n" for i, function in enumerate(functions)))


def lazy_call_grammar(functions: Sequence[FunctionBody], parallel: bool, format_: CallFormat,
                      token_of: Callable[[str], int | None]) -> str | None:
    """tool_choice `auto` as llama-server samples it (the lazy grammar of its chat layer, common/chat-auto-parser-
    generator.cpp): free text until the model writes the format's opener (its section's, else its call's), which is
    the trigger where it is one token of the model's; from that token on, calls of `functions` whose arguments match
    their parameters (call_grammar's), then the end. None where the opener is not one token, or where the format
    writes arguments as XML (call_grammar writes only the required ones there, which would forbid the optional ones
    a model may write): the answer is then free and its calls parsed afterwards, as before."""
    if format_.naming == "xml":
        return None
    opener = next((piece for piece in MARKUP.split(format_.section or format_.call_open) if piece), "")
    trigger = token_of(opener) if MARKUP.fullmatch(opener) else None
    if trigger is None:
        return None
    calls = call_grammar(functions, parallel, format_, token_of).replace("start:", "calls:", 1)
    return f"start: <[^{trigger}]>* calls?\n{calls}"


def _piece(piece: str, token_of: Callable[[str], int | None]) -> str:
    token = token_of(piece) if MARKUP.fullmatch(piece) else None
    return f"<[{token}]>" if token is not None else json.dumps(piece)


def _called(function: FunctionBody, format_: CallFormat, text: Callable[[str], str], freeform: bool) -> str:
    """The grammar of one call of `function` between the format's call_open and call_close (`freeform`: where a
    custom tool's call is among those the model may make, _call_object)."""
    parameters = function.parameters or ANY_OBJECT
    if format_.naming == "json":
        call = _call_object([function], format_) if freeform else f"%json {json.dumps(_envelopes([function], format_))}"
        return f'"\\n" {call} "\\n"'
    if format_.naming == "header":
        arguments = _freeform_arguments(function.input_grammar) if function.input_grammar else \
            f"%json {json.dumps({**parameters, 'x-guidance': TOOL_JSON_OPTIONS})}"
        return f"{text(format_.header_prefix + function.name + format_.header_end)} {arguments} \"\\n\"?"
    if function.input_grammar:  # the value is the raw text, read up to the first </parameter>: no grammar of it can
        # be held to stop short of that without intersecting the two
        raise ToolError(f"{function.input_grammar.param}: a Lark grammar cannot be enforced in this model's call "
                        f"format ({format_.name}, which writes a string argument raw); send a regex or text format",
                        function.input_grammar.param)
    return f'"\\n<function={function.name}>\\n" {_xml_parameters(parameters)} "</function>\\n"'


def _xml_parameters(parameters: dict[str, Any]) -> str:
    """Qwen3-Coder's <parameter=key> elements for the required properties, in order: a string's value as it is
    (one line), any other value as JSON."""
    properties = parameters.get("properties", {})
    parts = []
    for key in parameters.get("required", []):
        schema = properties.get(key, {})
        if schema.get("type") == "string":  # as it is, one line, within its maxLength
            value = f"/[^<\\n]{{1,{schema['maxLength']}}}/" if "maxLength" in schema else "/[^<\\n]+/"
        else:
            value = f"%json {json.dumps({**schema, 'x-guidance': TOOL_JSON_OPTIONS})}"
        parts.append(f'"<parameter={key}>\\n" {value} "\\n</parameter>\\n"')
    return " ".join(parts) or '""'


def _call_object(functions: Sequence[FunctionBody], format_: CallFormat) -> str:
    """A JSON call of one of `functions`, among which is a custom tool whose input follows a Lark grammar: each
    written out, {"name": "...", "arguments": ...}, its arguments under %json or, the custom tool's, its input
    JSON-escaped under that grammar. Not one %json of them all: llguidance follows a nested grammar (%json, %lark)
    beside another that starts where it does, or beside a literal, down one of them only."""
    options = []
    for function in functions:
        named = f"{{{json.dumps(format_.name_key)}: {json.dumps(function.name)}, {json.dumps(format_.arguments)}: "
        arguments = _freeform_arguments(function.input_grammar) if function.input_grammar else \
            f"%json {json.dumps({**(function.parameters or ANY_OBJECT), 'x-guidance': TOOL_JSON_OPTIONS})}"
        options.append(f"{json.dumps(named)} {arguments} {json.dumps('}')}")
    return options[0] if len(options) == 1 else f"({' | '.join(options)})"


def _freeform_arguments(grammar: InputGrammar) -> str:
    """A custom tool's arguments, {"input": "..."}, the string's text under its grammar, which is nested whole (its
    rule names and %ignore do not meet the call's)."""
    opening, closing = "{" + json.dumps(grammar.key) + ': "', '"}'
    return f"{json.dumps(opening)} %lark {{\n{grammar.lark}\n}} {json.dumps(closing)}"


def _listed(call: str, parallel: bool) -> str:
    """A JSON array of one call, or of one or more with `parallel`."""
    return f'"[" {call} (", " {call})* "]"' if parallel else f'"[" {call} "]"'


def _generic_calls(functions: Sequence[FunctionBody], parallel: bool, required: bool) -> str:
    """_generic_schema's answer where a custom tool's input follows a Lark grammar: written out, not one schema."""
    call = _call_object(functions, CallFormat("", (), "json"))
    key, calls = ("tool_calls", _listed(call, True)) if parallel else ("tool_call", call)
    answer = f"{json.dumps('{' + json.dumps(key) + ': ')} {calls} {json.dumps('}')}"
    if required:
        return answer
    reply = f"{json.dumps('{' + json.dumps('response') + ': ')} %json {json.dumps({'type': 'string'})} {json.dumps('}')}"
    return f"({answer} | {reply})"


def _envelopes(functions: Sequence[FunctionBody], format_: CallFormat) -> dict[str, Any]:
    """A JSON call of one of `functions`: {name_key: its name, arguments: its parameters' schema}."""
    return {"anyOf": [{"type": "object", "properties": {format_.name_key: {"const": f.name},
                                                        format_.arguments: f.parameters or ANY_OBJECT},
                       "required": [format_.name_key, format_.arguments], "additionalProperties": False}
                      for f in functions], "x-guidance": TOOL_JSON_OPTIONS}


def _generic_schema(functions: Sequence[FunctionBody], parallel: bool, required: bool) -> dict[str, Any]:
    """llama.cpp's generic answer: {"tool_call": call} ({"tool_calls": [calls]} with `parallel`), or, where no call
    is required, {"response": "..."}."""
    call = _envelopes(functions, CallFormat("", (), "json"))
    calls = ({"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
              "required": ["tool_calls"], "additionalProperties": False} if parallel else
             {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
              "additionalProperties": False})
    if required:
        return {**calls, "x-guidance": TOOL_JSON_OPTIONS}
    reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
             "additionalProperties": False}
    return {"anyOf": [calls, reply], "x-guidance": TOOL_JSON_OPTIONS}
