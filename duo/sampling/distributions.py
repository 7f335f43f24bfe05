"""A row of logits to the distribution a request samples from (SparseDist), and drawing from it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from duo.sampling.chain import chained, in_order, truncation_temperature
from duo.sampling.ops.infill import infill
from duo.sampling.ops.mirostat import kept_size, next_mu
from duo.sampling.ops.ranking import leading_ids
from duo.sampling.ops.temperature import dynamic_temperature
from duo.sampling.ops.truncation import min_p_size, nucleus_size, ranked_bound, typical_keep, untruncated_candidates
from duo.sampling.ops.xtc import xtc_removed
from duo.sampling.params import SamplingParams


class NoTokenAllowed(ValueError):
    """A row whose every token is banned (-inf): the request's logit_bias and grammar leave nothing to generate at
    this position. The request's own doing, not a fault of duo's."""


@dataclass(frozen=True, eq=False)  # eq=False: comparing numpy arrays with == is elementwise
class SparseDist:
    """A probability distribution over token ids, zero outside `ids`."""

    ids: np.ndarray  # [n] int64 token ids: most probable first, or in id order when nothing was truncated
    probs: np.ndarray  # [n] float64, positive, sums to 1

    def __post_init__(self) -> None:
        ids = np.asarray(self.ids, dtype=np.int64)
        probs = np.asarray(self.probs, dtype=np.float64)
        if ids.ndim != 1 or ids.shape != probs.shape or ids.size == 0:
            raise ValueError(f"SparseDist needs equal-length, non-empty 1-D ids and probs: {ids.shape}, {probs.shape}")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "probs", probs)

    @staticmethod
    def point(token: int) -> "SparseDist":
        """Certainty of one token: greedy's choice, or a free draft's q (duo.lookup)."""
        return SparseDist(np.array([token]), np.array([1.0]))


def distribution(logits: np.ndarray, params: SamplingParams, mu: float | None = None) -> SparseDist:
    """What `params` samples from after `logits` (the row as duo.sampling.rows.transform leaves it).

    Greedy: the top token. Mirostat (with its state `mu`): temperature, then mirostat alone (_mirostat), as llama.cpp
    replaces its chain. Otherwise llama.cpp's chain in params.order (duo.sampling.chain), by default as its
    common.h has it:
      top-n-sigma -> top-k -> typical -> top-p -> min-p -> xtc -> temperature (dynatemp where its range is set)
    so the truncations that read probabilities (typical, top-p, min-p, xtc) read them at temperature 1 and the
    temperature T shapes only what they leave; `samplers` can put it first (OpenAI's and vLLM's order: they read
    them at T), or anywhere. Top-n-sigma and top-k read only the logits' order and spread, the same at any T.
    min_keep holds top-p, typical, min-p and xtc to at least that many tokens; infill reshapes what is left.
    XTC's random cut makes the row's distribution the mixture P cut + (1 - P) uncut (ops.xtc). The orders the fast
    path below runs exactly (chain.truncation_temperature: the default, the temperature first, each step once) go
    through it; any other runs step by step (chain.chained).

    Every truncation but typical keeps a prefix of the tokens ranked by logit (ties: lower id first) and renormalises.
    With no truncation at all (the usual OpenAI-client request: a temperature and nothing else) nothing needs
    ranking: the support stays in id order, one softmax. On 151936 tokens (one AMD EPYC core, medians): top_k=40
    0.16 ms; top_p=0.95, peaked 0.45 ms; min_p=0.1 0.4 ms; none ~1 ms; top_p over a flat distribution 5-9 ms.
    """
    params.validate()
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array, got shape {logits.shape}")
    if params.greedy:
        return SparseDist.point(argmax(logits))
    top = logits.max()
    check_finite(top)
    if params.mirostat:
        return _mirostat(logits, top, params, mu)
    params = in_order(params)
    at = truncation_temperature(params)
    if at is None:
        return _mixed(*chained(logits, params))
    return _shaped(*_truncated(logits, top, params, at), logits, params, at)


def check_finite(top_logit: float) -> None:
    # NaN wins np.max/np.argmax, so checking the top logit also catches NaNs anywhere.
    if top_logit == -np.inf:
        raise NoTokenAllowed("the request's logit_bias and grammar leave no token allowed at this position: ban "
                             "fewer tokens (logit_bias false or -inf) or allow more in the grammar")
    if not np.isfinite(top_logit):
        raise ValueError(f"logits must be finite or -inf, found a top logit of {top_logit}")


def argmax(logits: np.ndarray) -> int:
    """Greedy's token: the top logit's id (ties: the lowest), checked (a row of -inf alone has none)."""
    best = int(np.argmax(logits))
    check_finite(logits[best])
    return best


def weights_of(logits: np.ndarray, top: float, temperature: float) -> np.ndarray:
    """Unnormalised softmax exp((l - max) / T) in float64; the top token weighs exactly 1."""
    # In place: each fresh vocab-sized float64 temporary costs page faults (~0.3 ms).
    weights = logits.astype(np.float64)
    weights -= top
    weights /= temperature
    return np.exp(weights, out=weights)


def _truncated(logits: np.ndarray, top: float, params: SamplingParams,
               temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """The ids left by top-n-sigma, top-k, typical, top-p and min-p (ops.truncation), and their weights (weights_of)
    at `temperature`, where the truncations read the probabilities."""
    bound = ranked_bound(logits, top, params.top_k, params.top_n_sigma)
    if bound is None and params.typical_p == 1:
        all_weights = weights_of(logits, top, temperature)
        mass = all_weights.sum()
        if params.top_p == 1 and params.min_p == 0:
            ids = np.flatnonzero(all_weights)  # exp underflow to 0 is the only cut
            return ids, all_weights[ids]
        ids = untruncated_candidates(logits, all_weights, mass, params.top_p, params.min_p, params.min_keep)
        weights = all_weights[ids]
    else:
        ids = leading_ids(logits, logits.size if bound is None else bound)
        weights = weights_of(logits[ids], top, temperature)
        ids, weights = ids[weights > 0], weights[weights > 0]
        mass = weights.sum()  # top-p below works on probabilities renormalised within what is left
        if params.typical_p < 1:
            keep = typical_keep(weights / mass, params.typical_p, params.min_keep)
            ids, weights = ids[keep], weights[keep]  # still ranked: a mask keeps the order
            mass = weights.sum()
    n = min(nucleus_size(weights, mass, params.top_p, params.min_keep),
            min_p_size(weights, params.min_p, params.min_keep, weights[0]))
    return ids[:n], weights[:n]


def _shaped(ids: np.ndarray, weights: np.ndarray, logits: np.ndarray, params: SamplingParams,
            at: float) -> SparseDist:
    """After the truncations (read at temperature `at`): XTC, then the temperature and infill. Where XTC's cut can
    fire, the mixture of the candidates cut (probability xtc_probability) and uncut, each through the temperature and
    infill, as llama.cpp's chain runs them."""
    probs = weights / weights.sum()
    removed = (xtc_removed(ids, probs, params.xtc_threshold, params.min_keep) if params.xtc_probability > 0
               else np.zeros(0, dtype=np.int64))
    uncut = _finished(ids, probs, logits, params, at)
    if not removed.size:
        return uncut
    stay = np.delete(np.arange(ids.size), removed)  # in rank order still
    cut = _finished(ids[stay], probs[stay] / probs[stay].sum(), logits, params, at)
    return _mixture(uncut, cut, params.xtc_probability)


def _finished(ids: np.ndarray, probs: np.ndarray, logits: np.ndarray, params: SamplingParams,
              at: float) -> SparseDist:
    """The temperature step where it comes after the truncations (`probs` are at `at`): T, or dynatemp (the
    probabilities at T_dyn: ops.temperature; T_dyn 0 keeps the top token); then infill."""
    if params.dynatemp_range == 0 and params.temperature != at and ids.size > 1:
        row = logits[ids]
        weights = weights_of(row, row.max(), params.temperature)
        ids, probs = ids[weights > 0], weights[weights > 0] / weights.sum()
    if params.dynatemp_range > 0 and ids.size > 1:
        row = logits[ids]
        t_dyn = dynamic_temperature(row, params.temperature, params.dynatemp_range, params.dynatemp_exponent)
        if t_dyn <= 0:
            return SparseDist.point(int(ids[np.argmax(row)]))
        weights = weights_of(row, row.max(), t_dyn)
        ids, probs = ids[weights > 0], weights[weights > 0] / weights.sum()
    if params.infill is not None and ids.size > 1:
        return SparseDist(*infill(ids, probs, params.infill, logits))
    return SparseDist(ids, probs)


def _mixed(weights: list[float], ids: list[np.ndarray], probs: list[np.ndarray]) -> SparseDist:
    """The mixture of the chain's outcomes (chain.chained): sum_j weights[j] (ids[j], probs[j])."""
    if len(weights) == 1:
        return SparseDist(ids[0], probs[0])
    merged, at = np.unique(np.concatenate(ids), return_inverse=True)
    total = np.bincount(at, weights=np.concatenate([w * p for w, p in zip(weights, probs)]))
    return SparseDist(merged[total > 0], total[total > 0])


def _mixture(a: SparseDist, b: SparseDist, weight_b: float) -> SparseDist:
    """(1 - w) a + w b, over the union of their supports (in id order)."""
    ids, at = np.unique(np.concatenate([a.ids, b.ids]), return_inverse=True)
    probs = np.bincount(at, weights=np.concatenate([(1 - weight_b) * a.probs, weight_b * b.probs]))
    return SparseDist(ids[probs > 0], probs[probs > 0])


def _mirostat(logits: np.ndarray, top: float, params: SamplingParams, mu: float | None) -> SparseDist:
    """Temperature, then mirostat's truncation at state mu (ops.mirostat), renormalised."""
    if mu is None:
        raise ValueError("mirostat needs its state mu (SamplingParams.start_mu before the first token)")
    weights = weights_of(logits, top, params.temperature)
    ids = leading_ids(logits, kept_size(logits, weights, mu, params.mirostat, params.top_k))
    return SparseDist(ids, weights[ids] / weights[ids].sum())


def advance(params: SamplingParams, mu: float | None, dist: SparseDist, token: int) -> float | None:
    """The sampler's state after `token` was drawn from `dist`: mirostat's next mu (ops.mirostat); `mu` as it is
    without mirostat or when greedy."""
    if mu is None or not params.mirostat or params.greedy:
        return mu
    return next_mu(mu, prob_of(dist, token), params.mirostat_tau, params.mirostat_eta)


def sample(dist: SparseDist, rng: np.random.Generator) -> int:
    """Draw one token id from `dist`."""
    return sample_weights(dist.ids, dist.probs, rng)


def sample_weights(ids: np.ndarray, weights: np.ndarray, rng: np.random.Generator) -> int:
    """Draw ids[i] with probability weights[i] / sum(weights); weights must be positive."""
    cdf = np.cumsum(weights)
    # side="right" never lands on a zero-width bucket; min() guards u * total rounding up to total.
    i = np.searchsorted(cdf, rng.random() * cdf[-1], side="right")
    return int(ids[min(i, ids.size - 1)])


def prob_of(dist: SparseDist, token: int) -> float:
    """dist's probability of one token (a linear scan: supports are small, or this is ~0.1 ms)."""
    return float(dist.probs[dist.ids == token].sum())  # ids are unique: one term or none


def chain_log_probs(rows: np.ndarray, tokens: Sequence[int], params: SamplingParams, mu: float | None,
                    top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each of `tokens` (drawn after its row of `rows`) with its log-probability under the distribution it was drawn
    from, after the whole chain (llama-server's post_sampling_probs), and the `top` most probable ids of that
    distribution with theirs (ties: lower id first); a token the chain leaves out is not listed, as llama-server
    lists none of probability 0. Mirostat's state advances along the tokens as the generation's did."""
    entries = []
    for row, token in zip(rows, tokens):
        dist = distribution(row, params, mu)
        order = np.lexsort((dist.ids, -dist.probs))[:top]
        best = [(int(dist.ids[i]), math.log(float(dist.probs[i]))) for i in order if dist.probs[i] > 0]
        entries.append((math.log(prob_of(dist, token)), best))
        mu = advance(params, mu, dist, token)
    return entries


def log_probs(row: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """log p(token) under softmax(row), the distribution before temperature and truncation, and the `top` most
    probable ids with theirs (OpenAI's and llama-server's logprobs): fewer where fewer are allowed, as in
    llama-server (a token the grammar or logit_bias bans has logit -inf: no probability, and -inf is no JSON)."""
    shifted = row.astype(np.float64) - row.max()
    log_z = math.log(np.exp(shifted).sum())
    top = min(top, int(np.count_nonzero(row > -np.inf)))
    best = leading_ids(row, top) if top else []
    return float(shifted[token] - log_z), [(int(i), float(shifted[i] - log_z)) for i in best]
