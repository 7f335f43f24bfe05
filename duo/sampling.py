"""Sampling math: logits to truncated distributions, sampling, and lossless verification of drafted chains."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from duo.infill_sampler import infill
from duo.noise import lowest_bits_below, uniforms, uniforms_of, vocabulary_bits
from duo.ranking import leading_ids
from duo.sampling_params import SamplingParams

# Without top-k, top-p first looks for its nucleus among this many leading tokens, then 16x as many, then
# the whole vocabulary. LLM next-token distributions are peaked: the first try almost always holds it.
_FIRST_CANDIDATES = 1024
_CANDIDATE_GROWTH = 16

# A rejection whose residual max(0, p - q) has less mass than this is float rounding of p == q (such a
# rejection itself has probability < this), so we sample from p instead of renormalising noise.
_MIN_RESIDUAL_MASS = 1e-12

# How a request's chain is verified (proto/duo.proto: Verification; Stats.verification).
GREEDY, COUPLED, RESIDUAL = "greedy", "coupled", "residual"


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


def distribution(logits: np.ndarray, params: SamplingParams) -> SparseDist:
    """What `params` samples from: greedy one-hot, or temperature -> top-k -> top-p -> min-p, then llama.cpp's
    infill transform where the request asks for it (duo.infill_sampler; a lone token stays as it is).

    Every truncation keeps a prefix of the tokens ranked by logit (ties: lower id first) and renormalises, so
    the result is that prefix and at least one token. With no truncation at all (the usual OpenAI-client
    request: a temperature and nothing else) nothing needs ranking: the support stays in id order, one softmax.
    On 151936 tokens (one AMD EPYC core, medians): top_k=40 0.16 ms; top_p=0.95, peaked 0.45 ms; min_p=0.1 0.4
    ms; none ~1 ms; top_p over a flat distribution (a nucleus of most of the vocabulary) 5-9 ms.
    """
    dist = _truncated(logits, params)
    return dist if params.infill is None or dist.ids.size == 1 else SparseDist(*infill(dist.ids, dist.probs,
                                                                                        params.infill, logits))


def _truncated(logits: np.ndarray, params: SamplingParams) -> SparseDist:
    params.validate()
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array, got shape {logits.shape}")
    if params.greedy:
        return SparseDist.point(_argmax(logits))

    top = logits.max()
    _check_finite(top)
    n_vocab = logits.size
    if 0 < params.top_k < n_vocab:
        ids = leading_ids(logits, params.top_k)
        weights = _weights(logits[ids], top, params.temperature)
        mass = weights.sum()  # top-p below works on probabilities renormalised within the top k
    else:
        all_weights = _weights(logits, top, params.temperature)
        mass = all_weights.sum()
        if params.top_p == 1 and params.min_p == 0:
            ids = np.flatnonzero(all_weights)  # exp underflow to 0 is the only cut
            return SparseDist(ids, all_weights[ids] / mass)
        ids = _untruncated_candidates(logits, all_weights, mass, params)
        weights = all_weights[ids]
    n = min(_nucleus_size(weights, mass, params.top_p), _min_p_size(weights, params.min_p))
    probs = weights[:n]
    probs /= probs.sum()  # in place: `weights` is already a fresh array
    return SparseDist(ids[:n], probs)


def _check_finite(top_logit: float) -> None:
    # NaN wins np.max/np.argmax, so checking the top logit also catches NaNs anywhere.
    if top_logit == -np.inf:
        raise NoTokenAllowed("the request's logit_bias and grammar leave no token allowed at this position: ban "
                             "fewer tokens (logit_bias false or -inf) or allow more in the grammar")
    if not np.isfinite(top_logit):
        raise ValueError(f"logits must be finite or -inf, found a top logit of {top_logit}")


def _argmax(logits: np.ndarray) -> int:
    """Greedy's token: the top logit's id (ties: the lowest), checked (a row of -inf alone has none)."""
    best = int(np.argmax(logits))
    _check_finite(logits[best])
    return best


def _weights(logits: np.ndarray, top: float, temperature: float) -> np.ndarray:
    """Unnormalised softmax exp((l - max) / T) in float64; the top token weighs exactly 1."""
    # In place: each fresh vocab-sized float64 temporary costs page faults (~0.3 ms).
    weights = logits.astype(np.float64)
    weights -= top
    weights /= temperature
    return np.exp(weights, out=weights)


def _untruncated_candidates(
    logits: np.ndarray, weights: np.ndarray, mass: float, params: SamplingParams
) -> np.ndarray:
    """Ranked leading ids that surely hold the final support when top-k is off.

    Min-p bounds the support up front: it keeps exactly the tokens with weight >= min_p
    (prob / max prob == weight). With min_p off, zero weights (exp underflow) are the bound.
    Top-p's nucleus is only known once the ranked mass reaches top_p, so we rank a small
    candidate set first and grow it only when its mass falls short.
    """
    bound = _min_p_size(weights, params.min_p)  # min-p leaves a ranked prefix of this length
    if params.top_p == 1:
        return leading_ids(logits, bound)
    n = min(_FIRST_CANDIDATES, bound)
    while True:
        ids = leading_ids(logits, n)
        if n == bound or weights[ids].sum() >= params.top_p * mass:
            return ids
        n = min(n * _CANDIDATE_GROWTH, bound)


def _nucleus_size(weights: np.ndarray, mass: float, top_p: float) -> int:
    """Length of the shortest ranked prefix whose probability (weights / mass) reaches top_p."""
    if top_p == 1:
        return weights.size
    reached = np.searchsorted(np.cumsum(weights), top_p * mass, side="left")
    return int(min(reached + 1, weights.size))  # the tail can fall short of top_p by rounding


def _min_p_size(weights: np.ndarray, min_p: float) -> int:
    """How many tokens have prob >= min_p * max prob, i.e. weight >= min_p; zeros never count.

    Weights fall with rank, so these are a ranked prefix. The top weight is exactly 1
    and min_p < 1, so the top token always stays.
    """
    return int(np.count_nonzero(weights >= min_p) if min_p > 0 else np.count_nonzero(weights))


def sample(dist: SparseDist, rng: np.random.Generator) -> int:
    """Draw one token id from `dist`."""
    return _sample_weights(dist.ids, dist.probs, rng)


def _sample_weights(ids: np.ndarray, weights: np.ndarray, rng: np.random.Generator) -> int:
    """Draw ids[i] with probability weights[i] / sum(weights); weights must be positive."""
    cdf = np.cumsum(weights)
    # side="right" never lands on a zero-width bucket; min() guards u * total rounding up to total.
    i = np.searchsorted(cdf, rng.random() * cdf[-1], side="right")
    return int(ids[min(i, ids.size - 1)])


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


def log_probs(row: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """log p(token) under softmax(row), the distribution before temperature and truncation, and the `top` most
    probable ids with theirs (OpenAI's and llama-server's logprobs): fewer where fewer are allowed, as in
    llama-server (a token the grammar or logit_bias bans has logit -inf: no probability, and -inf is no JSON)."""
    shifted = row.astype(np.float64) - row.max()
    log_z = math.log(np.exp(shifted).sum())
    top = min(top, int(np.count_nonzero(row > -np.inf)))
    best = leading_ids(row, top) if top else []
    return float(shifted[token] - log_z), [(int(i), float(shifted[i] - log_z)) for i in best]


def verify(
    draft_tokens: Sequence[int],
    draft_dists: Sequence[SparseDist] | None,
    target_logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    coupled_seed: int | None = None,
    start: int = 0,
) -> Verdict:
    """Verify a drafted chain whose first token is at position `start`: greedy when params.greedy,
    coupled with `coupled_seed`'s noise when given (draft_dists unused in both), else by residual
    rejection sampling with the rng."""
    if params.greedy:
        return verify_greedy(draft_tokens, target_logits)
    if coupled_seed is not None:
        return verify_coupled(draft_tokens, target_logits, params, coupled_seed, start)
    if draft_dists is None:
        raise ValueError("stochastic verification (temperature > 0) needs the draft distributions")
    return verify_stochastic(draft_tokens, draft_dists, target_logits, params, rng)


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
    return _verify_by_match(draft_tokens, target_logits, lambda row, i: _argmax(row))


def _verify_by_match(draft_tokens: Sequence[int], target_logits: np.ndarray,
                     pick: Callable[[np.ndarray, int], int]) -> Verdict:
    """Accept draft tokens while each equals the target's own pick(row i, i); then the target's pick
    where they part (recovered) or, with a row past the drafts, the bonus pick. Picks are made only
    for rows that are reached."""
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
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): output follows the target.

    At each position, p = distribution(row, params) (truncation included) and q = the
    draft distribution that draft token x was really sampled from. Accept x with
    probability min(1, p(x) / q(x)); on the first rejection emit a recovered token from
    the residual r = max(0, p - q) / sum(max(0, p - q)) and stop. Then
      P(emit y) = q(y) min(1, p(y) / q(y)) + P(reject) r(y)
                = min(p, q)(y) + (1 - sum min(p, q)) max(0, p - q)(y) / sum max(0, p - q)
                = min(p, q)(y) + max(0, p - q)(y) = p(y),
    because sum max(0, p - q) = 1 - sum min(p, q). An accepted token is exactly the
    token the target row after it was conditioned on, so the argument chains.
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
        q_x, p = _prob_of(q, drafted), None
        if q_x > 0:
            level = rng.random() * q_x  # accept when u < p(x)/q(x), with u in [0, 1)
            accepted = _p_exceeds_by_top(row, params, int(drafted), level)
            if accepted is None:
                p = distribution(row, params)
                accepted = _prob_of(p, drafted) > level
            if accepted:
                tokens.append(int(drafted))
                continue
        p = distribution(row, params) if p is None else p
        # q(x) == 0 means the draft did not sample x from q, so the accept/residual
        # pair (whose identity assumes x ~ q) does not apply: alone, the residual
        # emits max(0, p - q) normalised, which is not p. A fresh sample from p,
        # independent of x, is what keeps this position exactly target-distributed.
        recovered = _sample_residual(p, q, rng) if q_x > 0 else sample(p, rng)
        return Verdict(len(tokens), tokens + [recovered])
    if target_logits.shape[0] > len(draft_tokens):
        tokens.append(sample(distribution(target_logits[-1], params), rng))  # bonus
    return Verdict(len(draft_tokens), tokens)


def _p_exceeds_by_top(row: np.ndarray, params: SamplingParams, token: int, level: float) -> bool | None:
    """Whether p(token) > level, p = distribution(row, params), from the tokens near the top where nothing
    truncates (temperature alone: p's support is the whole vocabulary); None when they cannot tell, or
    when truncation applies (the caller then computes p).

    p(x) = w_x / Z with w = exp((l - max) / T). The tokens within _RACE_CUT * T of the top give
    Z_C <= Z, and each of the n others weighs less than b = e^-_RACE_CUT: Z <= Z_C + n b. So
    w_x > level (Z_C + n b) settles yes and w_x <= level Z_C settles no (with a margin far above
    float rounding); only p(x) within n b / Z_C (< 2% over 151,936 tokens) of the level needs Z itself.
    0.09 ms instead of 1.75 for a whole-vocabulary softmax (one Xeon core).
    """
    near = _near_top(row, params)
    if near is None or not 0 <= token < row.size:
        return None
    top, inside = near
    z_near = float(_weights(row[inside], top, params.temperature).sum())
    w_x = float(_weights(row[token:token + 1], top, params.temperature)[0])
    if w_x > level * (z_near + (row.size - np.count_nonzero(inside)) * _TAIL_WEIGHT) * (1 + 1e-9):
        return True
    if w_x <= level * z_near * (1 - 1e-9):
        return False
    return None


def _near_top(logits: np.ndarray, params: SamplingParams) -> tuple[float, np.ndarray] | None:
    """Where nothing truncates (temperature alone): the top logit, and which tokens lie within
    _RACE_CUT * T of it (every other token weighs less than _TAIL_WEIGHT); None for greedy or truncated
    sampling, whose support distribution() finds."""
    if params.greedy or 0 < params.top_k < logits.size or params.top_p < 1 or params.min_p > 0 or params.infill:
        return None
    params.validate()
    top = logits.max()
    _check_finite(top)
    kind = logits.dtype.type  # the cut rounded down in the logits' own type: below it, w < e^-_RACE_CUT
    return top, logits >= np.nextafter(kind(top - _RACE_CUT * params.temperature), kind(-np.inf))


def _prob_of(dist: SparseDist, token: int) -> float:
    """dist's probability of one token (a linear scan: supports are small, or this is ~0.1 ms)."""
    return float(dist.probs[dist.ids == token].sum())  # ids are unique: one term or none


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
    kept = residual > 0  # _sample_weights needs positive weights
    return _sample_weights(p.ids[kept], residual[kept], rng)


# --- Coupled sampling: the exponential race over duo.noise's shared noise (coupled_race: the cut) --
_RACE_CUT = 16.0
_TAIL_WEIGHT = math.exp(-_RACE_CUT) * (1 + 1e-9)  # above any weight past the cut, float64 rounding included


def coupled_ranking(dist: SparseDist, seed: int, position: int, n: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The n winners of the exponential race over dist's support, best first, with their keys
    ln(p / E) = log p + g (duo.noise). The first is the coupled sample at `position`."""
    ids, race = _race(dist.ids, dist.probs, uniforms(seed, position, dist.ids), n)
    return ids, np.log(race)


def _race(ids: np.ndarray, rates: np.ndarray, u: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n ids with the largest rate / E, E = -ln u, best first (ties: the earlier id in `ids`), and that."""
    race = rates / -np.log(u)
    best = np.array([np.argmax(race)]) if n == 1 else leading_ids(race, min(n, race.size))
    return ids[best], race[best]


def coupled_race(logits: np.ndarray, params: SamplingParams, seed: int, position: int,
                 n: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """coupled_ranking(distribution(logits, params), seed, position, n), keys shifted by ln of the softmax's
    normaliser, at a cost set by the tokens that can win. Truncated distributions are small: their race is
    run as is. An untruncated one races over the candidates within _RACE_CUT * T of the top logit (weight
    w >= e^-_RACE_CUT); K is the n-th best key w / E among them. A token past the cut (w_j < b) ranks
    above K only if E_j < w_j / K < b / K, which its noise's 53-bit integer shows (duo.noise.
    lowest_bits_below): those few race too. One integer hash per token instead of a softmax, a log and a
    division (1.3 ms, not 3.3, over 151,936 tokens on a Xeon core). Keys compare w / E, not (w / Z) / E:
    the same order in real numbers (a tie to the last bit may break otherwise than in coupled_ranking)."""
    logits, n_vocab = np.asarray(logits), np.size(logits)
    near = _near_top(logits, params)
    if near is None:
        return coupled_ranking(distribution(logits, params), seed, position, n)
    top, inside = near
    if np.count_nonzero(inside) < n:
        inside = logits >= np.partition(logits, n_vocab - n)[n_vocab - n]  # the n best at least
    ids = np.flatnonzero(inside)
    weights = _weights(logits[ids], top, params.temperature)
    if np.count_nonzero(weights) < n:  # exp underflows next to the top (T near 0): no bar to set
        return coupled_ranking(distribution(logits, params), seed, position, n)
    bits = vocabulary_bits(seed, position, n_vocab)
    ids, race = _race(ids, weights, uniforms_of(bits[ids]), n)
    rivals = np.flatnonzero((bits >= lowest_bits_below(_TAIL_WEIGHT / race[-1])) & ~inside)
    if rivals.size:
        rival_ids, rival_race = _race(rivals, _weights(logits[rivals], top, params.temperature),
                                      uniforms_of(bits[rivals]), n)
        ids, race = np.concatenate([ids, rival_ids]), np.concatenate([race, rival_race])
        best = np.lexsort((ids, -race))[:n]  # best first, ties: the lower id
        ids, race = ids[best], race[best]
    return ids, np.log(race)


def coupled_sample(dist: SparseDist, seed: int, position: int) -> int:
    return int(coupled_ranking(dist, seed, position)[0][0])


def verify_coupled(draft_tokens: Sequence[int], target_logits: np.ndarray, params: SamplingParams, seed: int,
                   start: int) -> Verdict:
    """Accept draft tokens while each is the target's own coupled sample at its position (row i is
    position start + i); then the target's sample where they part, or the bonus one."""
    return _verify_by_match(draft_tokens, target_logits,
                            lambda row, i: int(coupled_race(row, params, seed, start + i)[0][0]))
