"""Logprobs from the rows the target verified anyway: chat's logprobs/top_logprobs, the legacy completions
logprobs and llama-server's n_probs, whole and streamed, with the draft attached."""

from __future__ import annotations

import math

import numpy as np
import pytest

from duo.sampling.distributions import log_probs
from helpers.http import client, model_name, post, streamed

PROMPT = "Once upon a time"


def test_log_probs_are_the_softmax_of_the_row_and_its_best_alternatives():
    row = np.array([1.0, 3.0, 2.0, -np.inf], dtype=np.float32)
    logprob, top = log_probs(row, 2, 2)
    z = math.log(math.e ** 1 + math.e ** 3 + math.e ** 2)
    assert logprob == pytest.approx(2 - z) and [t for t, _ in top] == [1, 2] and top[0][1] == pytest.approx(3 - z)
    assert log_probs(row, 3, 0) == (-math.inf, [])


def test_chat_logprobs_match_the_target_alone_and_the_greedy_token_is_the_best(served_sync, served_alone, target_model):
    ask = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12, "temperature": 0,
           "logprobs": True, "top_logprobs": 3}
    duo = post(served_sync, "/v1/chat/completions", ask).json()
    alone = post(served_alone, "/v1/chat/completions", ask).json()
    assert duo["duo_stats"]["draft_tokens_accepted"] > 0
    content = duo["choices"][0]["logprobs"]["content"]
    assert len(content) == 12 and "".join(c["token"] for c in content) == duo["choices"][0]["message"]["content"]
    for entry in content:  # greedy: the chosen token is the most probable one
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["logprob"] <= 0 and entry["bytes"] == list(entry["token"].encode())
    by_alone = alone["choices"][0]["logprobs"]["content"]
    # Rows verified in batches of other shapes than alone's: the same numbers within float drift.
    assert [c["token"] for c in content] == [c["token"] for c in by_alone]
    assert np.allclose([c["logprob"] for c in content], [c["logprob"] for c in by_alone], atol=1e-2)


def test_the_sdk_streams_logprobs_and_legacy_completions_have_offsets(served_sync):
    api = client(served_sync)
    stream = api.chat.completions.create(model=model_name(served_sync), messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stream=True)
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert len(streamed) == 8 and all(len(e.top_logprobs) == 2 for e in streamed)
    legacy = post(served_sync, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                   "logprobs": 2}).json()["choices"][0]
    shown = legacy["logprobs"]
    assert "".join(shown["tokens"]) == legacy["text"] and len(shown["token_logprobs"]) == 6
    assert shown["text_offset"][0] == 0 and all(len(top) <= 2 for top in shown["top_logprobs"])
    assert [legacy["text"][o:o + len(t)] for o, t in zip(shown["text_offset"], shown["tokens"])] == shown["tokens"]


def test_llama_servers_n_probs_reports_completion_probabilities(served_alone):
    body = post(served_alone, "/completion", {"prompt": PROMPT, "n_predict": 5, "temperature": 0, "n_probs": 4}).json()
    probabilities = body["completion_probabilities"]
    assert [p["id"] for p in probabilities] == body["tokens"] and all(len(p["top_logprobs"]) == 4 for p in probabilities)
    events = streamed(served_alone, "/completion", {"prompt": PROMPT, "n_predict": 5, "temperature": 0, "n_probs": 1},
                      done=False)
    assert sum(len(e.get("completion_probabilities", [])) for e in events) == 5
