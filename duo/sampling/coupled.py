"""Coupled sampling: the exponential race over duo.sampling.noise's shared noise, whose winner is both sides' token."""

from __future__ import annotations

import math

import numpy as np

from duo.sampling.distributions import SparseDist, check_finite, distribution, weights_of
from duo.sampling.noise import lowest_bits_below, uniforms, uniforms_of, vocabulary_bits
from duo.sampling.params import SamplingParams
from duo.sampling.ops.ranking import leading_ids

RACE_CUT = 16.0
TAIL_WEIGHT = math.exp(-RACE_CUT) * (1 + 1e-9)  # above any weight past the cut, float64 rounding included


def coupled_ranking(dist: SparseDist, seed: int, position: int, n: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The n winners of the exponential race over dist's support, best first, with their keys
    ln(p / E) = log p + g (duo.sampling.noise). The first is the coupled sample at `position`."""
    ids, race = _race(dist.ids, dist.probs, uniforms(seed, position, dist.ids), n)
    return ids, np.log(race)


def _race(ids: np.ndarray, rates: np.ndarray, u: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n ids with the largest rate / E, E = -ln u, best first (ties: the earlier id in `ids`), and that."""
    race = rates / -np.log(u)
    best = np.array([np.argmax(race)]) if n == 1 else leading_ids(race, min(n, race.size))
    return ids[best], race[best]


def near_top(logits: np.ndarray, params: SamplingParams) -> tuple[float, np.ndarray] | None:
    """Where nothing truncates (temperature alone: params.plain): the top logit, and which tokens lie within
    RACE_CUT * T of it (every other token weighs less than TAIL_WEIGHT); None otherwise, where distribution() finds
    the support."""
    if params.greedy or not params.plain:
        return None
    params.validate()
    top = logits.max()
    check_finite(top)
    kind = logits.dtype.type  # the cut rounded down in the logits' own type: below it, w < e^-RACE_CUT
    return top, logits >= np.nextafter(kind(top - RACE_CUT * params.temperature), kind(-np.inf))


def coupled_race(logits: np.ndarray, params: SamplingParams, seed: int, position: int,
                 n: int = 1, mu: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """coupled_ranking(distribution(logits, params, mu), seed, position, n), keys shifted by ln of the softmax's
    normaliser, at a cost set by the tokens that can win. Truncated distributions are small: their race is
    run as is. An untruncated one races over the candidates within RACE_CUT * T of the top logit (weight
    w >= e^-RACE_CUT); K is the n-th best key w / E among them. A token past the cut (w_j < b) ranks
    above K only if E_j < w_j / K < b / K, which its noise's 53-bit integer shows (duo.sampling.noise.
    lowest_bits_below): those few race too. One integer hash per token instead of a softmax, a log and a
    division (1.3 ms, not 3.3, over 151,936 tokens on a Xeon core). Keys compare w / E, not (w / Z) / E:
    the same order in real numbers (a tie to the last bit may break otherwise than in coupled_ranking)."""
    logits, n_vocab = np.asarray(logits), np.size(logits)
    near = near_top(logits, params)
    if near is None:
        return coupled_ranking(distribution(logits, params, mu), seed, position, n)
    top, inside = near
    if np.count_nonzero(inside) < n:
        inside = logits >= np.partition(logits, n_vocab - n)[n_vocab - n]  # the n best at least
    ids = np.flatnonzero(inside)
    weights = weights_of(logits[ids], top, params.temperature)
    if np.count_nonzero(weights) < n:  # exp underflows next to the top (T near 0): no bar to set
        return coupled_ranking(distribution(logits, params), seed, position, n)
    bits = vocabulary_bits(seed, position, n_vocab)
    ids, race = _race(ids, weights, uniforms_of(bits[ids]), n)
    rivals = np.flatnonzero((bits >= lowest_bits_below(TAIL_WEIGHT / race[-1])) & ~inside)
    if rivals.size:
        rival_ids, rival_race = _race(rivals, weights_of(logits[rivals], top, params.temperature),
                                      uniforms_of(bits[rivals]), n)
        ids, race = np.concatenate([ids, rival_ids]), np.concatenate([race, rival_race])
        best = np.lexsort((ids, -race))[:n]  # best first, ties: the lower id
        ids, race = ids[best], race[best]
    return ids, np.log(race)


def coupled_sample(dist: SparseDist, seed: int, position: int) -> int:
    return int(coupled_ranking(dist, seed, position)[0][0])
