"""The weather tool and its required text, shared by the tool tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from duo.api.tools import call_grammar
from duo.constraint import Cursor, grammar_of
from duo.llama.worker import ModelWorker
from duo.sampling.params import SamplingParams
from duo.target.request import Request, SpecSettings
from duo.target.target import Target


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}


def token_of_in(model) -> Callable[[str], int | None]:
    """`model`'s id of its one token for a text (a call format's marker), or None where it takes several."""
    def token_of(text: str) -> int | None:
        tokens = model.tokenize(text, add_special=False)
        return tokens[0] if len(tokens) == 1 else None
    return token_of


def required_text(model, format_, functions, parallel=False) -> str:
    """What the tiny `model` writes under the grammar of a call required in `format_`."""
    grammar = grammar_of("lark", call_grammar(functions, parallel, format_, token_of_in(model)))

    async def run() -> list[int]:
        target = Target(model, ModelWorker(), None, n_ctx=256, settings=SpecSettings())
        request = Request(model.tokenize("Weather?"), SamplingParams(), max_tokens=120, grammar=grammar,
                          constraint=Cursor.compile(model, grammar))
        return [t async for step, _ in target.generate(request) for t in step.tokens]

    return model.detokenize(asyncio.run(run())).decode()
