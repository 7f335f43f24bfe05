"""Rows where the request bans tokens (logit_bias false or -inf, a grammar's mask): logprobs leave the banned tokens
out, and a position where nothing is allowed ends the request with NoTokenAllowed, not a fault of duo's."""

from __future__ import annotations

import asyncio
import json
import logging
import math

import numpy as np
import pytest

from duo.constraint import Cursor, grammar_of
from duo.llama.worker import ModelWorker
from duo.sampling.distributions import NoTokenAllowed
from duo.sampling.ops.penalties import Penalties
from duo.sampling.params import SamplingParams
from duo.target.target import Target
from duo.target.request import Request, SpecSettings
from helpers.http import post, streamed

ANSWER = "start: \"yes\" | \"no\""
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("params, seed", [(SamplingParams(), None), (SamplingParams(temperature=1.0), None),
                                          (SamplingParams(temperature=1.0), 7)], ids=["greedy", "residual", "coupled"])
def test_a_bias_that_bans_every_token_the_grammar_allows_ends_the_request_with_no_token_allowed(
        target_model, caplog, params, seed):
    grammar = grammar_of("lark", ANSWER)
    allowed = np.flatnonzero(Cursor.compile(target_model, grammar).allowed())
    request = Request(target_model.tokenize("Answer:"), params, seed=seed, max_tokens=4, grammar=grammar,
                      constraint=Cursor.compile(target_model, grammar),
                      penalties=Penalties(bias=tuple((int(token), -math.inf) for token in allowed)))

    async def run() -> list[int]:
        target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(adaptive=False))
        return [token async for step, _ in target.generate(request) for token in step.tokens]

    with caplog.at_level(logging.INFO, logger="duo.target"), pytest.raises(NoTokenAllowed, match="logit_bias"):
        asyncio.run(run())
    said = [record for record in caplog.records if "logit_bias" in record.getMessage()]
    assert said and all(record.exc_info is None for record in said)  # the request's doing: no traceback


def finite_only(name: str) -> float:
    raise AssertionError(f"{name} is not JSON")


def test_chat_logprobs_under_a_json_schema_are_finite_whole_and_streamed(served_sync):
    ask = {"messages": [{"role": "user", "content": "Describe a person as JSON."}], "max_tokens": 40,
           "temperature": 0, "logprobs": True, "top_logprobs": 5,
           "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    whole = post(served_sync, "/v1/chat/completions", ask)
    assert whole.status_code == 200, whole.text
    content = json.loads(whole.text, parse_constant=finite_only)["choices"][0]["logprobs"]["content"]
    # Where the schema allows fewer than 5 tokens (`{"` forced, say), fewer alternatives are listed.
    assert any(len(entry["top_logprobs"]) < 5 for entry in content)
    events = streamed(served_sync, "/v1/chat/completions", ask, parse_constant=finite_only)
    parts = [entry for event in events if event["choices"] and event["choices"][0].get("logprobs")
             for entry in event["choices"][0]["logprobs"]["content"]]
    assert [entry["token"] for entry in parts] == [entry["token"] for entry in content]
    for entry in content + parts:
        assert math.isfinite(entry["logprob"]) and 1 <= len(entry["top_logprobs"]) <= 5
        assert all(math.isfinite(top["logprob"]) for top in entry["top_logprobs"])
