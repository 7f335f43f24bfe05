"""llama.cpp's truncations of a row: top-n-sigma, top-k, locally typical, top-p and min-p (mirostat: ops.mirostat)."""

from __future__ import annotations

import numpy as np

from duo.sampling.ops.ranking import leading_ids

# Without top-k, top-p first looks for its nucleus among this many leading tokens, then 16x as many, then
# the whole vocabulary. LLM next-token distributions are peaked: the first try almost always holds it.
FIRST_CANDIDATES = 1024
CANDIDATE_GROWTH = 16


def ranked_bound(logits: np.ndarray, top: float, top_k: int, top_n_sigma: float) -> int | None:
    """How many of the ranked tokens top-n-sigma and top-k leave (a prefix); None where neither applies."""
    bound = top_k if 0 < top_k < logits.size else None
    if top_n_sigma > 0 and logits.size > 1:
        kept = int(np.count_nonzero(logits >= sigma_floor(logits, top, top_n_sigma)))
        bound = kept if bound is None else min(bound, kept)
    return bound


def sigma_floor(logits: np.ndarray, top: float, n: float) -> float:
    """Top-n-sigma (Tang et al. 2024; llama.cpp's top_n_sigma): the lowest logit kept, max - n sigma, with sigma the
    standard deviation of the finite logits (a banned token's -inf is left out, as llama.cpp leaves it).

    It keeps every logit >= the floor: a prefix of the ranked tokens, and the same one at any temperature
    ((l - max) / T >= -n sigma / T), so it keeps the same tokens before or after the temperature.
    """
    finite = logits[logits > -np.inf]
    return float(top - n * finite.std(dtype=np.float64))


def typical_keep(probs: np.ndarray, typical_p: float, min_keep: int) -> np.ndarray:
    """Locally typical sampling (Meister et al. 2022; llama.cpp's typical): which of the tokens with probabilities
    `probs` (positive, summing to 1, in any order) it keeps, as a boolean mask.

    With the entropy H = -sum p log p, tokens are taken in order of |-log p - H| (how far their surprise is from the
    expected one; ties in their given order) until their mass exceeds typical_p, and at least min_keep of them.
    The kept set is no prefix of the ranking: a very likely token can be atypical and leave.
    """
    log_p = np.log(probs)
    entropy = -float(np.dot(probs, log_p))
    order = np.argsort(np.abs(-log_p - entropy), kind="stable")
    reached = int(np.searchsorted(np.cumsum(probs[order]), typical_p, side="right"))  # the first index with mass > p
    n = min(max(reached + 1, min_keep), probs.size)
    keep = np.zeros(probs.size, dtype=bool)
    keep[order[:n]] = True
    return keep


def untruncated_candidates(logits: np.ndarray, weights: np.ndarray, mass: float, top_p: float, min_p: float,
                           min_keep: int) -> np.ndarray:
    """Ranked leading ids that surely hold the final support when nothing truncated before top-p and min-p
    (`weights`: the whole row's, weights_of in duo.sampling.distributions; `mass`: their sum).

    Min-p bounds the support up front: it keeps exactly the tokens with weight >= min_p
    (prob / max prob == weight), and at least min_keep. With min_p off, zero weights (exp underflow) are the bound.
    Top-p's nucleus is only known once the ranked mass reaches top_p, so we rank a small
    candidate set first and grow it only when its mass falls short.
    """
    bound = min_p_size(weights, min_p, min_keep)  # min-p leaves a ranked prefix of this length
    if top_p == 1:
        return leading_ids(logits, bound)
    n = min(max(FIRST_CANDIDATES, min_keep), bound)
    while True:
        ids = leading_ids(logits, n)
        if n == bound or weights[ids].sum() >= top_p * mass:
            return ids
        n = min(n * CANDIDATE_GROWTH, bound)


def nucleus_size(weights: np.ndarray, mass: float, top_p: float, min_keep: int) -> int:
    """Top-p: the length of the shortest ranked prefix whose probability (weights / mass) reaches top_p, and at least
    min_keep."""
    if top_p == 1:
        return weights.size
    reached = np.searchsorted(np.cumsum(weights), top_p * mass, side="left")
    return int(min(max(reached + 1, min_keep), weights.size))  # the tail can fall short of top_p by rounding


def min_p_size(weights: np.ndarray, min_p: float, min_keep: int, top_weight: float = 1.0) -> int:
    """Min-p: how many tokens have prob >= min_p * max prob, i.e. weight >= min_p * top_weight (the largest weight),
    and at least min_keep; zeros never count.

    Weights fall with rank, so these are a ranked prefix. min_p < 1, so the top token always stays.
    """
    nonzero = int(np.count_nonzero(weights))
    if min_p <= 0:
        return nonzero
    return min(max(int(np.count_nonzero(weights >= min_p * top_weight)), min_keep), nonzero)
