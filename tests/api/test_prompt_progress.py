"""llama-server's return_progress on duo: a stream tells how far its prompt's read got (prompt_progress: total,
cache, processed, time_ms), once before the read and after each call of --batch-size tokens, every report before the
first token and the last at the whole prompt; with timings_per_token, the timings so far. Nothing where the answer is
not streamed, and the same tokens with a draft attached."""

from __future__ import annotations

import math

import pytest

from conftest import CONTEXT_SIZE
from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.http import post, responses_events, streamed
from helpers.processes import channel, start, wait_for_draft

BATCH = 32  # the suite's tinyllama2 preset reads its prompts in calls of 32 tokens
PROMPT = "the quick brown fox jumps over the lazy dog " * 8


@pytest.fixture(scope="module")
def served_batch(tiny_target, process_logs):
    """duo-target without a draft, reading prompts in calls of BATCH tokens (llama-server's -b)."""
    process = start("duo.cli.target", ["--model", str(tiny_target), "--ctx-size", str(CONTEXT_SIZE), "-b", str(BATCH)],
                    process_logs, http=True)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def served_batch_duo(tiny_target, served_draft, process_logs):
    """The same beside a draft, in the synchronous mode: every step verifies the draft's tokens."""
    process = start("duo.cli.target", ["--model", str(tiny_target), "--ctx-size", str(CONTEXT_SIZE), "-b", str(BATCH),
                                       "--peer", served_draft.address, "--sync", "4"], process_logs, http=True)
    wait_for_draft(process.address)
    yield process
    process.stop()


def told(events: list[dict]) -> list[dict]:
    """The prompt_progress of the events that carry one, each checked to carry no text."""
    progress = [event for event in events if "prompt_progress" in event]
    assert all(event.get("content", "") == "" and not event.get("tokens") for event in progress)
    return [event["prompt_progress"] for event in progress]


def test_a_completion_stream_tells_its_read_before_its_first_token_in_calls_of_the_batch_size(served_batch):
    events = streamed(served_batch, "/completion", {"prompt": PROMPT, "n_predict": 4, "cache_prompt": False,
                                                    "return_progress": True, "timings_per_token": True})
    progress = told(events)
    first_text = next(i for i, event in enumerate(events) if event["tokens"])
    assert all("prompt_progress" in event for event in events[:first_text])  # every report before the first token
    assert not any("prompt_progress" in event for event in events[first_text:])
    total = progress[0]["total"]
    assert progress[0]["cache"] == progress[0]["processed"] == 0 and progress[-1]["processed"] == total
    assert len(progress) == 1 + math.ceil(total / BATCH)  # llama-server's count: before the read, then each call
    assert [p["processed"] for p in progress[1:-1]] == [BATCH * i for i in range(1, len(progress) - 1)]
    assert all(later["time_ms"] >= earlier["time_ms"] for earlier, later in zip(progress, progress[1:]))
    timings = [event["timings"] for event in events if "prompt_progress" in event]
    assert (timings[0]["prompt_n"], timings[0]["prompt_ms"], timings[0]["predicted_n"]) == (0, 0.0, 0)
    assert all(value >= 0 for t in timings for value in t.values())
    assert all(later["prompt_ms"] >= earlier["prompt_ms"] for earlier, later in zip(timings, timings[1:]))
    assert timings[-1]["prompt_ms"] > 0 and timings[-1]["prompt_n"] == total


def test_a_chat_stream_tells_its_read_with_the_assistants_role_and_a_cached_prompt_reads_only_its_end(served_batch):
    chat = {"max_tokens": 4, "messages": [{"role": "user", "content": "This is a test" * 10}], "return_progress": True}
    streamed(served_batch, "/v1/chat/completions", chat)  # the prompt is in the cache now
    chunks = streamed(served_batch, "/v1/chat/completions", chat)
    reports = [chunk for chunk in chunks if "prompt_progress" in chunk]
    assert all(chunk["choices"][0]["delta"] == {"role": "assistant", "content": None} for chunk in reports)
    assert "timings" not in reports[0]  # only timings_per_token puts them on every chunk
    progress = [chunk["prompt_progress"] for chunk in reports]
    total = progress[0]["total"]
    # as llama-server's: the cache first (all of the prompt but its last token), then the whole prompt
    assert [(p["total"], p["cache"], p["processed"]) for p in progress] == [(total, total - 1, total - 1),
                                                                            (total, total - 1, total)]


def test_only_a_stream_that_asks_tells_its_read(served_batch):
    whole = post(served_batch, "/completion", {"prompt": PROMPT, "n_predict": 2, "return_progress": True}).json()
    assert "prompt_progress" not in whole and whole["tokens_evaluated"] > BATCH
    assert not told(streamed(served_batch, "/completion", {"prompt": PROMPT, "n_predict": 2}))
    chat = post(served_batch, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                       "max_tokens": 2, "return_progress": True}).json()
    assert "prompt_progress" not in chat and chat["choices"][0]["message"]["content"] is not None


def test_a_completions_stream_tells_its_read_in_choices_of_no_text(served_batch):
    chunks = streamed(served_batch, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "cache_prompt": False,
                                                        "return_progress": True})
    reports = [chunk for chunk in chunks if "prompt_progress" in chunk]
    assert reports and all(chunk["choices"][0]["text"] == "" for chunk in reports)
    assert reports[-1]["prompt_progress"]["processed"] == reports[-1]["prompt_progress"]["total"]


def test_the_read_told_beside_a_draft_leaves_the_answer_the_targets_own(served_batch_duo, target_model):
    events = streamed(served_batch_duo, "/completion", {"prompt": PROMPT, "n_predict": 12, "temperature": 0,
                                                        "return_progress": True})
    progress = told(events)
    assert progress[-1]["processed"] == progress[-1]["total"]
    tokens = [token for event in events for token in event["tokens"]]
    assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPT, tokens, 12)
    assert events[-1]["timings"]["draft_n"] > 0  # the draft took part


def generated(process, **fields) -> list[pb.GenerateResponse]:
    with channel(process.address) as open_channel:
        request = pb.GenerateRequest(prompt=PROMPT, max_tokens=2, cache_prompt=False, **fields)
        return list(pb_grpc.TargetStub(open_channel).Generate(request, timeout=60))


def test_a_grpc_client_that_asks_gets_the_read_in_messages_of_no_text_before_the_first_token(served_batch):
    responses = generated(served_batch, return_progress=True)
    reports = [response for response in responses if response.HasField("progress")]
    assert responses[:len(reports)] == reports and all(not r.text and not r.token_ids for r in reports)
    total = reports[0].progress.total
    assert [r.progress.processed for r in reports] == [*range(0, total, BATCH), total]
    assert not any(response.HasField("progress") for response in generated(served_batch))


def test_a_responses_stream_tells_its_read_in_response_in_progress_events_and_its_timings_as_llama_server(
        served_batch):
    events = responses_events(served_batch, {"input": PROMPT, "max_output_tokens": 4, "timings_per_token": True,
                                             "return_progress": True, "stream": True})
    reports = [event for event in events if "prompt_progress" in event]
    assert reports and all(event["type"] == "response.in_progress" for event in reports)
    assert reports[-1]["prompt_progress"]["processed"] == reports[-1]["prompt_progress"]["total"]
    first_delta = next(i for i, event in enumerate(events) if event["type"] == "response.output_text.delta")
    assert events.index(reports[-1]) < first_delta and "timings" in events[first_delta]
    assert "timings" in events[-1] and events[-1]["type"] in ("response.completed", "response.incomplete")
    plain = responses_events(served_batch, {"input": PROMPT, "max_output_tokens": 4, "stream": True})
    assert not any("prompt_progress" in event for event in plain)
    assert [("timings" in event) for event in plain] == [False] * (len(plain) - 1) + [True]
