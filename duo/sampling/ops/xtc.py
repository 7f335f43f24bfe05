"""llama.cpp's XTC ("exclude top choices"): with probability P, every token at least `threshold` likely leaves but the
least likely of them, so that the text takes a less obvious turn where there are several good ones.

The cut is random, so the distribution a row samples from is the mixture p = P cut + (1 - P) uncut: the target
verifies against that mixture (residual and coupled verification are exact for any distribution), and the draft
draws from the same mixture. One draw from the mixture is exactly llama.cpp's coin, then its sample.
"""

from __future__ import annotations

import numpy as np

MAX_THRESHOLD = 0.5  # above it XTC is off, as in llama.cpp: two tokens cannot both be more likely than this


def xtc_removed(ids: np.ndarray, probs: np.ndarray, threshold: float, min_keep: int) -> np.ndarray:
    """Positions in `ids` the cut removes when it fires: the tokens with probability >= threshold, most probable
    first (ties: the lower id first), all but the last; none where fewer than two reach the threshold, or where fewer
    than min_keep tokens would stay (llama.cpp's conditions)."""
    if threshold > MAX_THRESHOLD or ids.size < 2:
        return np.zeros(0, dtype=np.int64)
    above = np.flatnonzero(probs >= threshold)
    if above.size < 2 or ids.size - (above.size - 1) < min_keep:
        return np.zeros(0, dtype=np.int64)
    return above[np.lexsort((ids[above], -probs[above]))][:-1]
