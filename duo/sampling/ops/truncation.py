"""llama.cpp's truncations beyond top-k, top-p and min-p: top-n-sigma and locally typical sampling."""

from __future__ import annotations

import numpy as np


def sigma_floor(logits: np.ndarray, top: float, n: float) -> float:
    """Top-n-sigma (Tang et al. 2024; llama.cpp's top_n_sigma): the lowest logit kept, max - n sigma, with sigma the
    standard deviation of the finite logits (a banned token's -inf is left out, as llama.cpp leaves it).

    It keeps every logit >= the floor: a prefix of the ranked tokens, and the same one at any temperature
    ((l - max) / T >= -n sigma / T), so applying it after duo's temperature changes nothing.
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
