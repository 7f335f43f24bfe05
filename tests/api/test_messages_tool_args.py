"""A call whose arguments are no JSON object is still answered by the Messages API (200, llama-server's input: {}),
whole and streamed alike: the model's text scripted, /v1/messages read by the anthropic SDK."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Sequence

import anthropic
import httpx2
import pytest

from duo.api.serving.admit import Admission
from duo.api.serving.generate import Completion, Completions, Piece
from duo.api.http import create_app
from duo.api.anthropic.answer import tool_input
from duo.api.serving.metrics import Metrics
from duo.api.serving.request import CompletionRequest
from duo.api.tools import HERMES, CallFormat
from duo.target.request import GenerationStats

TOOL = {"name": "get_weather", "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


class Released:
    """A completion's running place, as the scripted completions hold none."""

    def release(self) -> None:
        pass


class ScriptedCompletions(Completions):
    """Completions whose model writes `text` (in pieces of 3 characters) in Hermes' call format."""

    def __init__(self, text: str) -> None:
        super().__init__(Admission(1, 1), Metrics(), ["scripted"])
        self.text = text

    def call_format(self) -> CallFormat | None:
        return HERMES

    async def start_choices(self, requests: Sequence[CompletionRequest]) -> list[Completion]:
        return [Completion(self._pieces_of_text(), Released())]

    async def _pieces_of_text(self) -> AsyncGenerator[Piece, None]:
        for at in range(0, len(self.text), 3):
            last = at + 3 >= len(self.text)
            yield Piece(self.text[at:at + 3], [], "stop" if last else None, GenerationStats(prompt_tokens=5), False)


def call_text(arguments: str) -> str:
    return f'Looking.\n<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'


def client_of(text: str) -> anthropic.AsyncAnthropic:
    app = create_app(ScriptedCompletions(text), Metrics(), None)
    in_process = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://duo")  # the SDK's httpx
    return anthropic.AsyncAnthropic(base_url="http://duo", api_key="none", http_client=in_process, max_retries=0)


async def whole_and_streamed(text: str) -> tuple[anthropic.types.Message, anthropic.types.Message]:
    """The message the scripted model's `text` answers, whole and as the SDK assembles its stream."""
    ask = {"model": "any", "max_tokens": 64, "tools": [TOOL],
           "messages": [{"role": "user", "content": "The weather in Paris?"}]}
    whole = await client_of(text).messages.create(**ask)
    async with client_of(text).messages.stream(**ask) as stream:
        streamed = await stream.get_final_message()
    return whole, streamed


@pytest.mark.parametrize("arguments", ["{'city': 'Paris'}", "True", '{"city": NaN}', '{"city": Infinity}',
                                       '{"days": 1e999}', '{"city": "\\ud800"}', '["Paris"]'],
                         ids=["Python's dict", "a bare True", "NaN", "Infinity", "beyond a float", "a lone surrogate",
                              "a list"])
def test_a_call_whose_arguments_are_no_json_object_is_a_tool_use_with_an_empty_input_whole_and_streamed(arguments):
    whole, streamed = asyncio.run(whole_and_streamed(call_text(arguments)))
    for message in (whole, streamed):
        [text, call] = message.content
        assert text.text == "Looking.\n" and call.type == "tool_use" and call.name == "get_weather"
        assert call.input == {} and message.stop_reason == "tool_use"


def test_a_call_whose_arguments_are_a_json_object_keeps_them_whole_and_streamed():
    arguments = '{"city": "Paris \\"16e\\" {arr.}", "days": [1, 2.5e3]}'
    whole, streamed = asyncio.run(whole_and_streamed(call_text(arguments)))
    for message in (whole, streamed):
        assert message.content[1].input == json.loads(arguments)


def test_a_tool_use_input_is_the_models_text_where_it_is_a_json_object_and_else_empty():
    assert tool_input('{"city":  "Paris"}') == '{"city":  "Paris"}'  # as written, so that it streams unchanged
    for arguments in ("{'city': 'Paris'}", "True", "true", "[]", '"x"', "NaN", '{"a": -Infinity}', "", "[" * 10**5):
        assert tool_input(arguments) == "{}", arguments
