"""Lossless verification of a drafted chain against the target's rows: greedy, residual or coupled."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from duo.sampling import coupled
from duo.sampling.coupled import coupled_race, coupled_sample, near_top
from duo.sampling.distributions import (SparseDist, advance, argmax, distribution, prob_of, sample, sample_weights,
                                        weights_of)
from duo.sampling.params import SamplingParams

# A rejection whose residual max(0, p - q) has less mass than this is float rounding of p == q (such a
# rejection itself has probability < this), so we sample from p instead of renormalising noise.
_MIN_RESIDUAL_MASS = 1e-12

# How a request's chain is verified (proto/duo.proto: Verification; Stats.verification).
GREEDY, COUPLED, RESIDUAL = "greedy", "coupled", "residual"


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one drafted chain against the target.

    Vocabulary:
      *draft* tokens: proposed by the draft model, in chain order.
      *accepted* tokens: the longest prefix of the draft tokens that the target keeps.
      *recovered* token: on the first rejection, the target's replacement for the
        rejected draft token (resampled so the output stays target-distributed).
      *bonus* token: when every draft token is accepted and the target scored one
        position past the chain, a free token sampled from that last row.
    """

    n_accepted: int  # how many draft tokens were accepted (a prefix of the chain)
    tokens: list[int]  # the accepted draft tokens, then at most one recovered or bonus token
    # Where asked: each token's log-probability and the top alternatives' (log_probs), from its row.
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    mu: float | None = None  # mirostat's state after `tokens` (None without mirostat)


def verify(
    draft_tokens: Sequence[int],
    draft_dists: Sequence[SparseDist] | None,
    target_logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    coupled_seed: int | None = None,
    start: int = 0,
    mu: float | None = None,
) -> Verdict:
    """Verify a drafted chain whose first token is at position `start`, mirostat's state before it `mu`: greedy
    when params.greedy, coupled with `coupled_seed`'s noise when given (draft_dists unused in both), else by
    residual rejection sampling with the rng."""
    if params.greedy:
        return replace(verify_greedy(draft_tokens, target_logits), mu=mu)
    if coupled_seed is not None:
        return verify_coupled(draft_tokens, target_logits, params, coupled_seed, start, mu)
    if draft_dists is None:
        raise ValueError("stochastic verification (temperature > 0) needs the draft distributions")
    return verify_stochastic(draft_tokens, draft_dists, target_logits, params, rng, mu)


def _check_rows(draft_tokens: Sequence[int], target_logits: np.ndarray) -> np.ndarray:
    """target_logits as [r, n_vocab] with r == len(drafts) (no bonus) or len(drafts) + 1."""
    target_logits = np.asarray(target_logits)
    n = len(draft_tokens)
    if target_logits.ndim != 2 or target_logits.shape[0] not in (n, n + 1):
        raise ValueError(f"target_logits must have shape [{n} or {n + 1}, n_vocab] for {n} draft tokens, "
                         f"got {target_logits.shape}")
    return target_logits


def verify_greedy(draft_tokens: Sequence[int], target_logits: np.ndarray) -> Verdict:
    """Accept draft tokens while each is the target's argmax; then the recovered or bonus argmax.

    Row i holds the target's logits for the position of draft_tokens[i]. A draft id
    outside the target vocabulary never equals an argmax, so it is rejected.
    """
    return _verify_by_match(draft_tokens, target_logits, lambda row, i: argmax(row))


def _verify_by_match(draft_tokens: Sequence[int], target_logits: np.ndarray,
                     pick: Callable[[np.ndarray, int], int]) -> Verdict:
    """Accept draft tokens while each equals the target's own pick(row i, i); then the target's pick
    where they part (recovered) or, with a row past the drafts, the bonus pick. Picks are made only
    for rows that are reached, in order."""
    target_logits = _check_rows(draft_tokens, target_logits)
    tokens: list[int] = []
    for i, row in enumerate(target_logits):
        own = pick(row, i)
        if i == len(draft_tokens) or draft_tokens[i] != own:
            return Verdict(len(tokens), tokens + [own])
        tokens.append(own)
    return Verdict(len(tokens), tokens)


def verify_stochastic(
    draft_tokens: Sequence[int],
    draft_dists: Sequence[SparseDist],
    target_logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    mu: float | None = None,
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): output follows the target.

    At each position, p = distribution(row, params, mu) (truncation included) and q = the
    draft distribution that draft token x was really sampled from. Accept x with
    probability min(1, p(x) / q(x)); on the first rejection emit a recovered token from
    the residual r = max(0, p - q) / sum(max(0, p - q)) and stop. Then
      P(emit y) = q(y) min(1, p(y) / q(y)) + P(reject) r(y)
                = min(p, q)(y) + (1 - sum min(p, q)) max(0, p - q)(y) / sum max(0, p - q)
                = min(p, q)(y) + max(0, p - q)(y) = p(y),
    because sum max(0, p - q) = 1 - sum min(p, q). An accepted token is exactly the
    token the target row after it was conditioned on, so the argument chains; so does mirostat's
    state, walked token by token (mu after row i follows the token emitted there: duo.sampling.ops.mirostat).
    The residual vanishes wherever p does, so it is computed on p's support only. An accepted row needs
    p(x) alone, which _p_exceeds_by_top bounds without the whole vocabulary; only the step's last row samples
    from all of p.
    Draft ids outside the target vocabulary have p(x) = 0 and are always rejected;
    the draft's mass on them just never offsets any p, which the identity above allows.
    p is computed only for rows that are reached.
    """
    target_logits = _check_rows(draft_tokens, target_logits)
    if len(draft_dists) != len(draft_tokens):
        raise ValueError(f"got {len(draft_dists)} draft distributions for {len(draft_tokens)} draft tokens")
    tokens: list[int] = []
    for row, drafted, q in zip(target_logits, draft_tokens, draft_dists):
        q_x, p = prob_of(q, drafted), None
        if q_x > 0:
            level = rng.random() * q_x  # accept when u < p(x)/q(x), with u in [0, 1)
            accepted = _p_exceeds_by_top(row, params, int(drafted), level)
            if accepted is None:
                p = distribution(row, params, mu)
                accepted = prob_of(p, drafted) > level
            if accepted:
                tokens.append(int(drafted))
                mu = advance(params, mu, p, int(drafted)) if p is not None else mu
                continue
        p = distribution(row, params, mu) if p is None else p
        # q(x) == 0 means the draft did not sample x from q, so the accept/residual
        # pair (whose identity assumes x ~ q) does not apply: alone, the residual
        # emits max(0, p - q) normalised, which is not p. A fresh sample from p,
        # independent of x, is what keeps this position exactly target-distributed.
        recovered = _sample_residual(p, q, rng) if q_x > 0 else sample(p, rng)
        return Verdict(len(tokens), tokens + [recovered], mu=advance(params, mu, p, recovered))
    if target_logits.shape[0] > len(draft_tokens):
        p = distribution(target_logits[-1], params, mu)
        bonus = sample(p, rng)
        tokens.append(bonus)
        mu = advance(params, mu, p, bonus)
    return Verdict(len(draft_tokens), tokens, mu=mu)


def _p_exceeds_by_top(row: np.ndarray, params: SamplingParams, token: int, level: float) -> bool | None:
    """Whether p(token) > level, p = distribution(row, params), from the tokens near the top where nothing
    truncates (temperature alone: p's support is the whole vocabulary); None when they cannot tell, or
    when truncation applies (the caller then computes p).

    p(x) = w_x / Z with w = exp((l - max) / T). The tokens within RACE_CUT * T of the top give
    Z_C <= Z, and each of the n others weighs less than b = e^-RACE_CUT: Z <= Z_C + n b. So
    w_x > level (Z_C + n b) settles yes and w_x <= level Z_C settles no (with a margin far above
    float rounding); only p(x) within n b / Z_C (< 2% over 151,936 tokens) of the level needs Z itself.
    0.09 ms instead of 1.75 for a whole-vocabulary softmax (one Xeon core). RACE_CUT: duo.sampling.coupled's.
    """
    near = near_top(row, params)
    if near is None or not 0 <= token < row.size:
        return None
    top, inside = near
    z_near = float(weights_of(row[inside], top, params.temperature).sum())
    w_x = float(weights_of(row[token:token + 1], top, params.temperature)[0])
    if w_x > level * (z_near + (row.size - np.count_nonzero(inside)) * coupled.TAIL_WEIGHT) * (1 + 1e-9):
        return True
    if w_x <= level * z_near * (1 - 1e-9):
        return False
    return None


def _probs_at(dist: SparseDist, ids: np.ndarray) -> np.ndarray:
    """dist's probabilities at many ids, through an id-indexed lookup table.

    np.zeros pages are zeroed lazily, so with small supports only the touched pages
    cost anything (~10 us for 40 ids); with two whole-vocabulary supports this takes
    0.3 ms where binary search (argsort + searchsorted) took ~28 ms on cache misses.
    """
    table = np.zeros(max(dist.ids.max(), ids.max()) + 1)
    table[dist.ids] = dist.probs
    return table[ids]


def _sample_residual(p: SparseDist, q: SparseDist, rng: np.random.Generator) -> int:
    """Recovered token: sample from max(0, p - q), normalised (falls back to p if that is ~0)."""
    residual = np.maximum(p.probs - _probs_at(q, p.ids), 0.0)
    if residual.sum() < _MIN_RESIDUAL_MASS:
        return sample(p, rng)
    kept = residual > 0  # sample_weights needs positive weights
    return sample_weights(p.ids[kept], residual[kept], rng)


def verify_coupled(draft_tokens: Sequence[int], target_logits: np.ndarray, params: SamplingParams, seed: int,
                   start: int, mu: float | None = None) -> Verdict:
    """Accept draft tokens while each is the target's own coupled sample at its position (row i is
    position start + i); then the target's sample where they part, or the bonus one. Under mirostat each
    row's distribution follows mu after the tokens before it."""
    if mu is None:
        return _verify_by_match(draft_tokens, target_logits,
                                lambda row, i: int(coupled_race(row, params, seed, start + i)[0][0]))
    state = [mu]

    def pick(row: np.ndarray, i: int) -> int:
        dist = distribution(row, params, state[0])
        token = coupled_sample(dist, seed, start + i)
        state[0] = advance(params, state[0], dist, token)
        return token

    return replace(_verify_by_match(draft_tokens, target_logits, pick), mu=state[0])
