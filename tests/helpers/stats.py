"""Statistics for tests of sampling: chi-square p-values, the significance level, first-token trials."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from scipy.stats import chisquare

from duo.sampling.distributions import SparseDist, distribution
from duo.sampling.params import SamplingParams
from duo.sampling.verification import Verdict


ALPHA = 1e-3  # chi-square p-value below which "the output is not target-distributed"


def dense(dist: SparseDist, n_vocab: int) -> np.ndarray:
    """[n_vocab] float64 probabilities; mass on ids >= n_vocab is dropped, not redistributed.

    The draft vocabulary may be larger than the target's; dropping (rather than
    renormalising) keeps dense(q)[i] == q(i), so e.g. sum(min(p, q)) stays the acceptance rate.
    """
    out = np.zeros(n_vocab)
    inside = dist.ids < n_vocab
    out[dist.ids[inside]] = dist.probs[inside]
    return out


def probs_to_logits(probs: list[float]) -> np.ndarray:
    with np.errstate(divide="ignore"):  # zero probability -> -inf logit
        return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def normalised(x: np.ndarray) -> np.ndarray:
    return x / x.sum()


Verifier = Callable[..., Verdict]


TRIALS = 15_000


def first_token_trials(
    verifier: Verifier, target_row: np.ndarray, q: SparseDist, params: SamplingParams, seed: int = 0
) -> tuple[np.ndarray, int]:
    """Draft x ~ q and verify it TRIALS times.

    Returns the counts of the first emitted token and how many draft tokens were accepted.
    """
    rng = np.random.default_rng(seed)
    rows = target_row[None, :]
    counts = np.zeros(target_row.size, dtype=np.int64)
    accepted = 0
    for drafted in rng.choice(q.ids, size=TRIALS, p=q.probs):
        verdict = verifier([drafted], [q], rows, params, rng)
        counts[verdict.tokens[0]] += 1
        accepted += verdict.n_accepted
    return counts, accepted


def chi_square_pvalue(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value that `counts` were drawn from `expected_probs`; impossible ids must not occur."""
    support = expected_probs > 0
    never = np.flatnonzero(counts * ~support)
    assert never.size == 0, f"emitted tokens the target never would: {never}"
    expected = counts.sum() * normalised(expected_probs[support])
    return chisquare(counts[support], expected).pvalue


P_TARGET = [0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02]


def verify_resampling_from_p(
    draft_tokens: list[int],
    draft_dists: list[SparseDist],
    target_logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
) -> Verdict:
    """Deliberately WRONG verifier: on rejection it samples p, not the residual max(0, p - q)."""
    n_vocab = target_logits.shape[1]
    tokens: list[int] = []
    for row, x, q in zip(target_logits, draft_tokens, draft_dists):
        p = dense(distribution(row, params), n_vocab)
        q_x = dense(q, n_vocab + 128)[x]
        if rng.random() * q_x < p[x]:
            tokens.append(int(x))
            continue
        return Verdict(len(tokens), tokens + [int(rng.choice(n_vocab, p=p))])
    return Verdict(len(tokens), tokens)
