"""A prompt read partly and then abandoned (the client left: an agent's idle timeout, a user's stop) is not read again
from the start when the client sends it again: its chunks read stay in the cache as a reusable prefix, the request
that left says what it found there, and its read stops at the next chunk boundary."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest

from duo.api.http import create_app
from duo.api.serving.admit import Admission
from duo.api.serving.generate import Completions
from duo.api.serving.metrics import Metrics
from duo.llama.model import N_BATCH
from duo.llama.worker import ModelWorker
from duo.target.request import SpecSettings
from duo.target.target import Target
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.held_calls import HOLD_S, HeldCalls
from helpers.http import sse_events

N_CTX = 2048  # the tiny model's training context
PROMPT = [(7 * i) % 5000 + 100 for i in range(1700)]  # read in chunks of N_BATCH (512, 512, 512), then its end
BODY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def post(app, body: dict, leave: asyncio.Event | None = None) -> str:
    """POST /v1/completions to the app as uvicorn does; the client leaves (http.disconnect) once `leave` is set."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080)}
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[bytes] = []

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await (leave or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message.get("body", b""))

    await app(scope, receive, send)
    return b"".join(sent).decode()


def streamed(text: str) -> tuple[str, dict]:
    """A streamed completion's text and its usage."""
    chunks = sse_events(text.splitlines())
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks[-1]["usage"]


async def left_during_the_read(app, held: HeldCalls, after: int) -> None:
    """A request for PROMPT whose client leaves while the prompt chunk after `after` more is decoded; that chunk is
    let go only once the request has ended."""
    held.hold(after)
    leave = asyncio.Event()
    request = asyncio.ensure_future(post(app, BODY, leave))
    assert await asyncio.to_thread(held.reached.wait, HOLD_S)
    leave.set()
    await asyncio.wait_for(request, HOLD_S)  # ended while its chunk is still on the model thread
    held.release()


def serve(model, parallel: int) -> tuple[Target, Completions]:
    target = Target(model, ModelWorker(), None, n_ctx=N_CTX, settings=SpecSettings(), parallel=parallel)
    completions = Completions(Admission(parallel, 4), Metrics(), ["tiny"])
    completions.ready(target, N_CTX)
    return target, completions


def cached_in_log(records: list[logging.LogRecord]) -> list[int]:
    """Each ended request's cached prompt tokens, as its line in the target's log says them."""
    return [int(m.group(1)) for r in records if (m := re.search(r"prompt \d+ tokens \((\d+) cached\)", r.getMessage()))]


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_prompt_abandoned_twice_midway_is_read_once_in_all_and_answered_as_a_cold_read(target_model, caplog,
                                                                                          parallel):
    """Codex CLI's case: its stream idle timeout dropped the first turn while the prompt was read, and it sent the
    same request again from the start, twice."""
    caplog.set_level(logging.INFO, logger="duo.target")
    target, completions = serve(target_model, parallel)
    app = create_app(completions, completions.metrics, None)

    async def three_tries() -> tuple[str, str, list[tuple[int, int]]]:
        try:
            held = HeldCalls((await target.batcher()).context)
            await left_during_the_read(app, held, after=1)  # left during its 2nd chunk: the 3rd is never read
            first = held.prompt_chunks()
            await left_during_the_read(app, held, after=0)  # the retry reads on from there, and leaves too
            last = await post(app, BODY)
            return first, held.prompt_chunks(), last
        finally:
            await target.close()

    first, chunks, last = asyncio.run(three_tries())
    assert first == [(0, N_BATCH), (N_BATCH, N_BATCH)]  # the chunk in flight ends; the read stops there
    read_by_retry = (2 * N_BATCH, N_BATCH)  # the last whole chunk; what is left over rides with the first token
    assert chunks == [*first, read_by_retry]  # each chunk read once, the last try's end in its first step
    text, usage = streamed(last)
    assert usage["prompt_tokens_details"]["cached_tokens"] == sum(read_by_retry)
    # The retry that left too says what it found, in the log and the metrics, as a finished request does.
    assert cached_in_log(caplog.records) == [0, 2 * N_BATCH, sum(read_by_retry)]
    assert completions.metrics.prompt_tokens_cached._value.get() == 2 * N_BATCH + sum(read_by_retry)
    cold = asyncio.run(cold_answer(target_model))
    assert text == cold or leaves_greedy_path_only_at_a_near_tie(target_model, PROMPT, text, BODY["max_tokens"])


async def cold_answer(model) -> str:
    """PROMPT's answer from a target that never saw it."""
    target, completions = serve(model, 1)
    try:
        return streamed(await post(create_app(completions, completions.metrics, None), BODY))[0]
    finally:
        await target.close()
