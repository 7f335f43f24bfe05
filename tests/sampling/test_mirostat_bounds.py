"""Mirostat at the edges of what a request may set: a state mu far below zero or far above it (a large eta with a small
tau drives it there within tokens) truncates as llama.cpp's float math does, never an overflow; served, such requests
answer 200 on every path that reaches mirostat, and values outside the accepted ranges 400 naming the field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from duo.sampling.distributions import advance, distribution, sample
from duo.sampling.ops.mirostat import next_mu, v1_size, v2_size
from duo.sampling.params import MAX_FLOAT_FIELD, SamplingParams
from helpers.http import post

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
ZIPF = np.arange(1, 101) ** -1.1 / (np.arange(1, 101) ** -1.1).sum()  # mirostat v1's leading probabilities


@pytest.mark.parametrize("mu", [-1e-9, -1.0, -1024.0, -1025.0, -1e6, -math.inf, math.nan])
def test_mirostat_v2_keeps_the_top_token_alone_for_a_negative_mu(mu):
    """Every surprise -log2 p is >= 0: none is within a negative mu (llama.cpp then keeps one token)."""
    weights = np.exp(LOGITS)
    assert v2_size(weights, weights.sum(), mu) == 1
    assert distribution(LOGITS, SamplingParams(temperature=1.0, mirostat=2), mu).ids.tolist() == [0]


@pytest.mark.parametrize("mu", [1075.0, 1e6, math.inf])
def test_mirostat_v2_keeps_every_token_for_a_huge_mu(mu):
    dist = distribution(LOGITS, SamplingParams(temperature=1.0, mirostat=2), mu)
    assert dist.ids.tolist() == [0, 1, 2, 3] and np.allclose(dist.probs, np.exp(LOGITS))


@pytest.mark.parametrize("mu, k", [(-1e6, 1), (-math.inf, 1), (1e6, 151936), (math.inf, 151936)])
def test_mirostat_v1_keeps_one_token_or_the_whole_vocabulary_at_the_extremes(mu, k):
    assert v1_size(ZIPF, mu, 151936) == k


def test_mirostat_carries_an_infinite_mu_as_a_float_would():
    assert next_mu(math.inf, 0.5, 5.0, 0.1) == math.inf and next_mu(-math.inf, 0.5, 5.0, 0.1) == -math.inf
    assert next_mu(-1e6, 0.5, 0.0, MAX_FLOAT_FIELD) == -1e6 - MAX_FLOAT_FIELD


@pytest.mark.parametrize("version", [1, 2])
def test_the_largest_eta_with_a_small_tau_keeps_sampling_row_after_row(version):
    """mu = 2 tau keeps the top token (surprise 0): mu rises by eta tau to 1e4, every token is kept, the next draw's
    surprise sends mu to about -1e7; from there each row keeps its top token."""
    params = SamplingParams(temperature=1.0, mirostat=version, mirostat_tau=0.01, mirostat_eta=MAX_FLOAT_FIELD)
    rng = np.random.default_rng(version)
    mu, lowest = params.start_mu(), math.inf
    for _ in range(12):
        logits = rng.normal(0, 1, 64)
        dist = distribution(logits, params, mu)
        if mu < 0:
            assert dist.ids.tolist() == [int(np.argmax(logits))]
        mu = advance(params, mu, dist, sample(dist, rng))
        lowest = min(lowest, mu)
    assert lowest < -1024  # where 2^-mu overflows a float


MIROSTAT_EXTREMES = {"temperature": 1.0, "seed": 7, "mirostat_tau": 0.01, "mirostat_eta": MAX_FLOAT_FIELD}


@pytest.mark.parametrize("version", [1, 2])
def test_a_completion_with_the_extreme_mirostat_answers_200_with_and_without_a_draft(served_alone, served_sync,
                                                                                       version):
    body = {"prompt": "Once upon a time", "n_predict": 12, "mirostat": version, **MIROSTAT_EXTREMES}
    for served in (served_alone, served_sync):
        response = post(served, "/completion", body)
        assert response.status_code == 200, response.text
        assert response.json()["tokens"]


def test_a_chat_and_a_streamed_chat_with_the_extreme_mirostat_answer_200(served_alone):
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12, "mirostat": 2,
            **MIROSTAT_EXTREMES}
    answered = post(served_alone, "/v1/chat/completions", body)
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["message"]["content"]
    streamed = post(served_alone, "/v1/chat/completions", {**body, "stream": True})
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text and '"error"' not in streamed.text


@pytest.mark.parametrize("field, value", [("mirostat_tau", -1.0), ("mirostat_tau", 1e7), ("mirostat_eta", -0.1),
                                          ("mirostat_eta", 1e7), ("mirostat", 3)])
def test_mirostat_fields_outside_their_ranges_answer_400_naming_the_field(served_alone, field, value):
    body = {"prompt": "hi", "n_predict": 4, "temperature": 1.0, "mirostat": 2, field: value}
    response = post(served_alone, "/completion", body)
    assert response.status_code == 400, response.text
    assert field in response.text
