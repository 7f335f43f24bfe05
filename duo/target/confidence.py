"""Acceptance given the draft's confidence: how often the target accepts a draft the draft model gave probability c."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from duo.costs import MovingAverage

# Bin edges of the draft's confidence, finer near 1 where most drafts of a good draft fall and where acceptance
# changes fastest (0.98 is nearly always accepted, 0.9 noticeably less). The last bin holds 0.99 to 1 inclusive.
CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)
# Each bin starts as if it had seen this many drafts accepted at its mid-point, so that its first observations move
# it without swinging it to 0 or 1 (the weight the positional rates' prior has: duo.target.policy.PRIOR_WEIGHT).
CALIBRATION_PRIOR_WEIGHT = 2.0


@dataclass
class Calibration:
    """The chance that a draft the draft model gave probability c is accepted (given those before it were), by bins
    of c, learnt online from every step of one sampling mode's requests.

    A bin's prior is its mid-point, what a calibrated draft earns: a sampled draft x ~ q is accepted with
    min(1, p(x) / q(x)), q(x) on average where the target's p agrees with q near x; a greedy one is accepted where
    x is the target's argmax too, at least as often as p(x) where p(x) > 1/2. `observed` counts each bin's own
    observations: until it has one, its value is the prior's alone, and the policy keeps its positional rate.
    Example: drafts at confidence 0.4 accepted 1 time in 10 bring bin [0.3, 0.5) from 0.4 towards 0.1.
    """

    rates: list[MovingAverage]
    observed: list[int]

    @classmethod
    def prior(cls) -> Calibration:
        mids = [(low + high) / 2 for low, high in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:])]
        return cls([MovingAverage(mid, CALIBRATION_PRIOR_WEIGHT) for mid in mids], [0] * len(mids))

    @staticmethod
    def bin_of(confidence: float) -> int:
        return min(bisect.bisect_right(CONFIDENCE_EDGES, confidence) - 1, len(CONFIDENCE_EDGES) - 2)

    def rate(self, confidence: float) -> float | None:
        """The acceptance of a draft at `confidence`, None while its bin has seen no draft."""
        i = self.bin_of(confidence)
        return self.rates[i].value if self.observed[i] else None

    def observe(self, confidences: Sequence[float | None], n_accepted: int) -> None:
        """Learn from one step's verified drafts of the model's chain (their confidences, None where the draft sent
        none), of which the first `n_accepted` were accepted: drafts past the first rejection were never judged."""
        for position, confidence in enumerate(confidences[:n_accepted + 1]):
            if confidence is not None:
                i = self.bin_of(confidence)
                self.rates[i].add(1.0 if position < n_accepted else 0.0)
                self.observed[i] += 1
