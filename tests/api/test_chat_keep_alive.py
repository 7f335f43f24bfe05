"""A slow target's chat stream stays alive: an SSE comment each time a while passes with nothing to send (the prompt
read, a ```json call held until whole), which the openai SDK skips, assembling the same answer."""

from __future__ import annotations

import asyncio

import httpx2
import openai

from duo.api.http import create_app
from duo.api.openai import answers
from duo.api.serving.metrics import Metrics
from helpers.slow_model import SlowCompletions

TOOLS = [{"type": "function", "function": {"name": "write", "description": "Write a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}]
BODY = {"model": "slow", "messages": [{"role": "user", "content": "create hello.py"}], "tools": TOOLS, "stream": True}
# Qwen2.5-Coder's own form: a ```json block, held until whole (duo.api.output.calls.reader.CallReader.holding).
FENCED_CALL = (["Writing.\n", "```json\n", '{"name": "write", "arguments": '] + ['{"path": "hello.py", '] +
               ['"content": "'] + ["print(1)\\n"] * 8 + ['"}}', "\n```"])


def slow_chat(pieces: list[str], prompt_s: float, piece_s: float) -> tuple[str, openai.types.chat.ChatCompletion]:
    """The raw stream of the slow model's chat answer, and the answer the openai SDK assembles from it."""
    app = create_app(SlowCompletions(pieces, prompt_s, piece_s), Metrics(), None)

    async def streamed():
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://duo")
        raw = (await http.post("/v1/chat/completions", json=BODY)).text
        client = openai.AsyncOpenAI(base_url="http://duo/v1", api_key="none", max_retries=0, http_client=http)
        async with client.chat.completions.stream(**{k: v for k, v in BODY.items() if k != "stream"}) as stream:
            assembled = await stream.get_final_completion()
        return raw, assembled
    return asyncio.run(streamed())


def test_while_the_prompt_is_read_and_a_fenced_call_is_held_the_stream_sends_keep_alives(monkeypatch):
    monkeypatch.setattr(answers, "KEEP_ALIVE_S", 0.05)
    raw, assembled = slow_chat(FENCED_CALL, prompt_s=0.5, piece_s=0.06)
    events = [event for event in raw.split("\n\n") if event]
    first_data = next(i for i, event in enumerate(events) if event.startswith("data: "))
    assert first_data == 0  # the opening chunk (the role) at once
    text_at = next(i for i, event in enumerate(events) if "Writing." in event)
    assert events[1:text_at] == [answers.KEEP_ALIVE.strip()] * (text_at - 1) and text_at >= 5  # 0.5 s of reading
    call_at = next(i for i, event in enumerate(events) if '"tool_calls"' in event)
    assert answers.KEEP_ALIVE.strip() in events[text_at + 1:call_at]  # the call's 0.6 s, held
    message = assembled.choices[0].message
    assert message.content == "Writing.\n" and assembled.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls
    assert call.function.name == "write"
    assert call.function.arguments.replace(" ", "") == '{"path":"hello.py","content":"' + "print(1)\\n" * 8 + '"}'


def test_a_stream_that_never_waits_long_sends_no_keep_alive():
    raw, assembled = slow_chat(FENCED_CALL, prompt_s=0, piece_s=0)
    assert answers.KEEP_ALIVE.strip() not in raw and raw.rstrip().endswith("data: [DONE]")
    assert assembled.choices[0].message.tool_calls[0].function.name == "write"
