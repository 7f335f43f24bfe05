"""Mirostat (Basu et al. 2021; llama.cpp's mirostat and mirostat-v2): a truncation steered by a state mu, the surprise
allowed, which each drawn token moves towards the target surprise tau.

After a token x drawn from the truncated, renormalised q: mu' = mu - eta (-log2 q(x) - tau). Row i's distribution
depends on mu after the tokens before it, so under speculation the target walks mu along the chain it verifies (an
accepted draft, then the recovered or bonus token) and keeps the mu of what it committed (duo.sampling.verification).
"""

from __future__ import annotations

import math

import numpy as np

from duo.sampling.ops.ranking import leading_ids

V1_SAMPLE = 100  # mirostat v1 estimates the Zipf exponent from the m most probable tokens (llama.cpp's m)


def next_mu(mu: float, prob: float, tau: float, eta: float) -> float:
    """mu after drawing a token whose probability in the distribution it was drawn from is `prob`."""
    return mu - eta * (-math.log2(prob) - tau)


def v2_size(weights: np.ndarray, mass: float, mu: float) -> int:
    """Mirostat v2: how many of the most probable tokens have a surprise -log2 p <= mu (p = weight / mass), at least
    one; they are a prefix of the ranking.

    Every surprise is >= 0, so a negative mu keeps the top token alone, as llama.cpp's float math does; asked
    directly, 2^-mu would overflow a float below mu = -1024 (a large eta with a small tau drives mu there)."""
    if not mu >= 0:  # NaN too: no surprise is within it
        return 1
    return max(int(np.count_nonzero(weights >= mass * 2.0 ** -mu)), 1)  # 2^-mu underflows to 0 for a large mu: all


def v1_size(leading_probs: np.ndarray, mu: float, n_vocab: int) -> int:
    """Mirostat v1's k from the ranked probabilities of the V1_SAMPLE most probable tokens: the Zipf exponent
      s = sum t_i b_i / sum t_i^2,  t_i = ln((i + 2) / (i + 1)),  b_i = ln(p_i / p_(i+1)),
    then k = (e 2^mu / (1 - N^-e))^(1 / s) with e = s - 1 and N the vocabulary's size, as an integer from 1 to N
    (computed in logs: 2^mu overflows for a large mu; e -> 0 takes the limit e / (1 - N^-e) -> 1 / ln N)."""
    p = leading_probs[leading_probs > 0]
    if p.size < 2:
        return 1
    i = np.arange(p.size - 1)
    t = np.log((i + 2) / (i + 1))
    s = float(np.dot(t, np.log(p[:-1] / p[1:])) / np.dot(t, t))
    e = s - 1
    ratio = 1 / math.log(n_vocab) if abs(e) < 1e-12 else e / -math.expm1(-e * math.log(n_vocab))
    with np.errstate(divide="ignore", invalid="ignore"):
        log_k = np.float64(math.log(ratio) + mu * math.log(2)) / np.float64(s)
    if np.isnan(log_k):
        return 1
    return int(min(max(math.exp(min(float(log_k), 700.0)), 1.0), n_vocab))


def kept_size(logits: np.ndarray, weights: np.ndarray, mu: float, version: int, top_k: int) -> int:
    """How many of the ranked tokens mirostat `version` keeps at state mu (v1 a top-k of its Zipf estimate, v2 the
    tokens of surprise <= mu), then top-k where set: llama.cpp ignores the other samplers under mirostat (duo's HTTP
    API leaves top-k off with it), and the draft caps its q so. `weights`: the row's softmax at its temperature,
    unnormalised (weights_of in duo.sampling.distributions)."""
    mass, nonzero = weights.sum(), int(np.count_nonzero(weights))
    if version == 2:
        n = v2_size(weights, mass, mu)
    else:
        n = v1_size(weights[leading_ids(logits, min(V1_SAMPLE, nonzero))] / mass, mu, logits.size)
    return min(n, top_k or n, nonzero)
