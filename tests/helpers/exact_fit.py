"""Whether sampled continuations follow the target's exact distribution: goodness of fit against the
target's own probabilities (decoded here), not against a second sample, so a test needs half the
samples for the same power.

Position 0 is tested against p(. | prompt) over its most probable tokens (the rest pooled). Position 1
depends on the token before it, so each sample's second token is mapped to its rank under p(. | prompt,
its first token), and the counts of ranks are tested against the sum over samples of those conditional
probabilities: the expected count of rank r given the first tokens that occurred, a valid test whatever
they were (a wrong first-token distribution shows at position 0).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Sequence

import numpy as np
from scipy.stats import chisquare

from duo.llama.model import Model
from duo.sampling.distributions import distribution
from duo.sampling.params import SamplingParams

TOP = 8  # the most probable tokens (or ranks) tested apart; the rest are pooled


def first_two_p_values(model: Model, prompt: list[int], samples: Sequence[Sequence[int]],
                       params: SamplingParams) -> tuple[float, float]:
    """Chi-square p-values that the first and second tokens of `samples` follow the target."""
    ranked = _ranked_distribution(model, tuple(prompt), params)
    first = Counter(sample[0] for sample in samples)
    top_ids, top_probs = ranked(())
    observed = [first[token] for token in top_ids] + [len(samples) - sum(first[token] for token in top_ids)]
    expected = np.append(top_probs, 1 - top_probs.sum()) * len(samples)
    p_first = chisquare(*_pooled(observed, expected)).pvalue

    observed_ranks, expected_ranks = np.zeros(TOP + 1), np.zeros(TOP + 1)
    for sample in samples:
        ids, probs = ranked((sample[0],))
        rank = ids.index(sample[1]) if sample[1] in ids else TOP
        observed_ranks[rank] += 1
        expected_ranks[:len(probs)] += probs
        expected_ranks[TOP] += 1 - probs.sum()
    p_second = chisquare(*_pooled(observed_ranks, expected_ranks)).pvalue
    return float(p_first), float(p_second)


def _ranked_distribution(model: Model, prompt: tuple[int, ...], params: SamplingParams):
    """prefix -> (the TOP most probable token ids after prompt + prefix, their probabilities), cached."""
    @functools.cache
    def ranked(prefix: tuple[int, ...]) -> tuple[list[int], np.ndarray]:
        context = model.new_context(len(prompt) + len(prefix) + 1)
        try:
            dist = distribution(context.decode([*prompt, *prefix], 0)[-1], params)
        finally:
            context.close()
        order = np.argsort(-dist.probs, kind="stable")[:TOP]
        return [int(token) for token in dist.ids[order]], dist.probs[order]

    return ranked


def _pooled(observed: Sequence[float], expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Categories expected fewer than 5 times merged into the last one (chi-square's usual rule)."""
    observed, expected = np.asarray(observed, dtype=float), np.asarray(expected, dtype=float)
    keep = expected >= 5
    keep[-1] = False
    merged_obs = np.append(observed[keep], observed[~keep].sum())
    merged_exp = np.append(expected[keep], expected[~keep].sum())
    if merged_exp[-1] == 0:
        merged_obs, merged_exp = merged_obs[:-1], merged_exp[:-1]
    return merged_obs, merged_exp * merged_obs.sum() / merged_exp.sum()
