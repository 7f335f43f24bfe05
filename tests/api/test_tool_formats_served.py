"""Tool calls in other families' formats, served with the draft attached: a model whose template is Qwen3-Coder's
writes XML calls, one whose template has no tool syntax answers llama.cpp's generic JSON; streamed through the
openai SDK, each call assembles into the call of the whole answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.processes import Process, start, wait_for_draft
from helpers.http import client
from helpers.tiny_models import write_tiny_model

# As Qwen3-Coder's GGUFs ship it (a copy is kept in llama.cpp: models/templates/Qwen3-Coder.jinja).
QWEN3_CODER = (Path(__file__).parents[1] / "data" / "templates" / "qwen3-coder.jinja").read_text()
# ChatML with no tool syntax at all (SmolLM2's and many base models' templates): llama.cpp's generic format.
PLAIN_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer"}},
                   "required": ["city", "days"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module", params=["qwen3-coder", "no tool syntax"])
def served_family(request, tiny_target: Path, tmp_path_factory, served_draft, process_logs: Path) -> Iterator[Process]:
    """The test target's weights and vocabulary under another family's chat template, beside the same draft."""
    template = QWEN3_CODER if request.param == "qwen3-coder" else PLAIN_CHATML
    path = write_tiny_model(tmp_path_factory.mktemp("family") / "tiny-family.gguf", seed=0, base=tiny_target,
                            embedding_type="f32", chat_template=template)
    process = start("duo.cli.target", ["--model", str(path), "--peer", served_draft.address, "--sync", "4"],
                    process_logs, http=True)
    wait_for_draft(process.address)
    yield process
    process.stop()


def ask(process: Process, **fields):
    return client(process).chat.completions.create(model="any", messages=ASK, tools=[WEATHER], max_tokens=120,
                                                   temperature=0, tool_choice="required", **fields)


def test_a_streamed_call_in_the_families_format_assembles_into_the_whole_answers_call(served_family):
    whole = ask(served_family)
    assert whole.choices[0].finish_reason == "tool_calls", whole
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city", "days"}
    assert whole.model_extra["duo_stats"]["draft_tokens_accepted"] > 0
    calls: dict[int, dict] = {}
    finish = None
    for chunk in ask(served_family, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        assert not (delta.content and delta.tool_calls), delta  # content and calls never share a delta
        assert len(delta.tool_calls or []) <= 1, delta  # one call's entry per chunk
        for entry in delta.tool_calls or []:
            assembled = calls.setdefault(entry.index, {"id": entry.id, "name": "", "arguments": ""})
            assembled["name"] += entry.function.name or ""
            assembled["arguments"] += entry.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (call.function.name, json.loads(call.function.arguments))]
    assert all(c["id"] for c in calls.values())


def test_the_sdks_stream_helper_assembles_the_same_call(served_family):
    whole = ask(served_family).choices[0].message.tool_calls[0]
    with client(served_family).chat.completions.stream(model="any", messages=ASK, tools=[WEATHER], max_tokens=120,
                                                       temperature=0, tool_choice="required") as stream:
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert streamed.function.name == whole.function.name
    assert json.loads(streamed.function.arguments) == json.loads(whole.function.arguments)
