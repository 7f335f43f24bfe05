"""llama-server's post_sampling_probs: each token's probability, and its n_probs alternatives', under the distribution
it was drawn from (after the whole sampler chain), named prob and top_probs; on /completion and on chat. Reported
from the target's verified rows: with a draft attached, the tokens and their probabilities are the target's alone."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.http import post

PROMPT = "Today was the day. Today I would finally become a"
TOP_K = 5
CHAIN = {"temperature": 1.0, "top_k": TOP_K, "top_p": 1.0, "min_p": 0.0, "seed": 7}


def completion(process, **fields) -> dict:
    response = post(process, "/completion", {"prompt": PROMPT, "n_predict": 6, "n_probs": 10, **CHAIN, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def by_hand(target_model, tokens: list[int]) -> list[dict[int, float]]:
    """The chain's distribution after each token's prefix, by hand: the TOP_K likeliest logits' softmax (T 1)."""
    prompt = target_model.tokenize(PROMPT)
    context = target_model.new_context(len(prompt) + len(tokens) + 1)
    try:
        rows = [context.decode(prompt, 0)[-1]] + [context.decode([token], context.n_past)[-1] for token in tokens[:-1]]
    finally:
        context.close()
    shown = []
    for row in rows:
        kept = np.argsort(-row.astype(np.float64), kind="stable")[:TOP_K]
        weights = np.exp(row[kept].astype(np.float64) - row[kept].max())
        shown.append(dict(zip(kept.tolist(), (weights / weights.sum()).tolist())))
    return shown


def test_post_sampling_probs_are_the_chains_distribution_of_the_target_alone(served_sync, served_alone,
                                                                              target_model):
    body = completion(served_sync, post_sampling_probs=True)
    assert body["timings"]["draft_n_accepted"] > 0
    probabilities = body["completion_probabilities"]
    assert [entry["id"] for entry in probabilities] == body["tokens"]
    for entry, expected in zip(probabilities, by_hand(target_model, body["tokens"])):
        assert "logprob" not in entry and "top_logprobs" not in entry
        assert entry["prob"] == pytest.approx(expected[entry["id"]], abs=1e-3)
        assert len(entry["top_probs"]) == TOP_K  # the chain keeps TOP_K tokens, fewer than n_probs
        assert {top["id"]: top["prob"] for top in entry["top_probs"]} == pytest.approx(expected, abs=1e-3)
        assert [top["prob"] for top in entry["top_probs"]] == sorted((top["prob"] for top in entry["top_probs"]),
                                                                     reverse=True)
    assert body["generation_settings"]["post_sampling_probs"] is True
    alone = completion(served_alone, post_sampling_probs=True)
    assert alone["tokens"] == body["tokens"]  # the seed's tokens, draft or not


def test_without_it_the_probabilities_stay_log_probabilities_of_the_row(served_alone):
    entry = completion(served_alone)["completion_probabilities"][0]
    assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 10 and "prob" not in entry


def test_chat_logprobs_after_the_chain_are_probabilities_too(served_alone):
    response = post(served_alone, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 3,
        "post_sampling_probs": True, **CHAIN})
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert content and all(0 < entry["prob"] <= 1 and len(entry["top_probs"]) == 3 for entry in content)


def test_legacy_completions_refuse_it_naming_the_field(served_alone):
    response = post(served_alone, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 2,
                                                      "post_sampling_probs": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "post_sampling_probs"
