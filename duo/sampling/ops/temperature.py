"""llama.cpp's dynamic temperature (dynatemp, its temp-ext sampler): a temperature that follows the row's entropy."""

from __future__ import annotations

import math

import numpy as np


def dynamic_temperature(logits: np.ndarray, temperature: float, spread: float, exponent: float) -> float:
    """The temperature for the candidates whose logits are `logits` (two or more):
      T_dyn = T_min + (T_max - T_min) (H / H_max)^exponent,  T_min = max(0, T - spread),  T_max = T + spread,
    with H the entropy of the candidates' softmax at temperature 1 and H_max = ln n the entropy of n equal ones:
    a confident row samples cooler, an open one hotter."""
    shifted = logits.astype(np.float64) - logits.max()
    weights = np.exp(shifted)
    probs = weights / weights.sum()
    positive = probs > 0
    entropy = -float(np.dot(probs[positive], np.log(probs[positive])))
    low, high = max(0.0, temperature - spread), temperature + spread
    return low + (high - low) * (entropy / math.log(logits.size)) ** exponent
