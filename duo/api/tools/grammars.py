"""Grammars that make the model call a tool in its template's own format: for tool_choice `required` or a named
function, and for the generic JSON format (whose every answer is written under one)."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Sequence

from duo.api.tools.formats import CallFormat
from duo.api.tools.messages import FunctionBody
from duo.constraint import JSON_OPTIONS

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

    if format_.naming == "generic":
        return f"start: %json {json.dumps(_generic_schema(functions, parallel, required))}\n"
    if format_.naming == "json" and (format_.listed or format_.at_start):
        call = _envelopes(functions, format_)
        if format_.at_start:
            return f"start: %json {json.dumps(call)}\n"
        calls = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1}),
                 "x-guidance": JSON_OPTIONS}
        return f'start: {text(format_.section)} " "? %json {json.dumps(calls)} {text(format_.section_end)}\n'
    return (f'start: {text(format_.section)} call{"+" if parallel else ""} {text(format_.section_end)}\n'
            f"call: {' | '.join(f'call_{i}' for i in range(len(functions)))}\n"
            + "".join(f"call_{i}: {text(format_.call_open)} {_called(function, format_, text)} "
                      f"{text(format_.call_close)} \"\\n\"?\n" for i, function in enumerate(functions)))


def _piece(piece: str, token_of: Callable[[str], int | None]) -> str:
    token = token_of(piece) if MARKUP.fullmatch(piece) else None
    return f"<[{token}]>" if token is not None else json.dumps(piece)


def _called(function: FunctionBody, format_: CallFormat, text: Callable[[str], str]) -> str:
    """The grammar of one call of `function` between the format's call_open and call_close."""
    parameters = function.parameters or ANY_OBJECT
    if format_.naming == "json":
        return f'"\\n" %json {json.dumps(_envelopes([function], format_))} "\\n"'
    if format_.naming == "header":
        return (f"{text(format_.header_prefix + function.name + format_.header_end)} "
                f"%json {json.dumps({**parameters, 'x-guidance': JSON_OPTIONS})} \"\\n\"?")
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
            value = f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"
        parts.append(f'"<parameter={key}>\\n" {value} "\\n</parameter>\\n"')
    return " ".join(parts) or '""'


def _envelopes(functions: Sequence[FunctionBody], format_: CallFormat) -> dict[str, Any]:
    """A JSON call of one of `functions`: {name_key: its name, arguments: its parameters' schema}."""
    return {"anyOf": [{"type": "object", "properties": {format_.name_key: {"const": f.name},
                                                        format_.arguments: f.parameters or ANY_OBJECT},
                       "required": [format_.name_key, format_.arguments], "additionalProperties": False}
                      for f in functions], "x-guidance": JSON_OPTIONS}


def _generic_schema(functions: Sequence[FunctionBody], parallel: bool, required: bool) -> dict[str, Any]:
    """llama.cpp's generic answer: {"tool_call": call} ({"tool_calls": [calls]} with `parallel`), or, where no call
    is required, {"response": "..."}."""
    call = _envelopes(functions, CallFormat("", (), "json"))
    calls = ({"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
              "required": ["tool_calls"], "additionalProperties": False} if parallel else
             {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
              "additionalProperties": False})
    if required:
        return {**calls, "x-guidance": JSON_OPTIONS}
    reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
             "additionalProperties": False}
    return {"anyOf": [calls, reply], "x-guidance": JSON_OPTIONS}
