"""A streamed chat ends as llama-server ends it: the finish_reason comes in a chunk of its own whose delta is empty,
after every chunk of text; the text streamed is the target's own greedy answer with a draft attached."""

from __future__ import annotations

from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.http import post, streamed

MESSAGES = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


def chat_chunks(process, body: dict) -> list[dict]:
    return streamed(process, "/v1/chat/completions", {"messages": MESSAGES, "temperature": 0, **body}, done=True)


def test_the_finish_reason_comes_alone_in_an_empty_delta_after_the_text(served_sync, target_model):
    chunks = chat_chunks(served_sync, {"max_tokens": 12})
    choices = [chunk["choices"][0] for chunk in chunks]
    assert choices[0]["delta"] == {"role": "assistant", "content": None}
    assert choices[-1]["delta"] == {} and choices[-1]["finish_reason"] == "length"
    assert all(choice["finish_reason"] is None for choice in choices[:-1])
    content = "".join(choice["delta"].get("content") or "" for choice in choices)
    prompt = post(served_sync, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                        "verbose": True}).json()["__verbose"]["prompt"]
    assert leaves_greedy_path_only_at_a_near_tie(target_model, target_model.tokenize(prompt), content, 12)
    assert chunks[-1]["duo_stats"]["draft_tokens_accepted"] > 0


def test_with_usage_the_empty_finish_chunk_is_followed_by_the_usage_chunk(served_sync):
    chunks = chat_chunks(served_sync, {"max_tokens": 6, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["delta"] == {} and chunks[-2]["choices"][0]["finish_reason"] == "length"
