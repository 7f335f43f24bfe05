"""llama.cpp's sampler chain in the order a request gives (SamplingParams.order), step by step over the candidates."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from duo.sampling.ops.infill import infill
from duo.sampling.ops.ranking import leading_ids
from duo.sampling.ops.temperature import dynamic_temperature
from duo.sampling.ops.truncation import min_p_size, nucleus_size, typical_keep
from duo.sampling.ops.xtc import MAX_THRESHOLD, xtc_removed
from duo.sampling.params import SamplingParams

_TRUNCATIONS = "skypmx"  # the steps duo.sampling.distributions' fast path runs, in this order


def active_steps(params: SamplingParams) -> str:
    """The steps of params.order that change the candidates (top-k 0, top-p 1, temperature 1, ... pass them on
    unchanged, as llama.cpp's empty samplers do), in the order's turn."""
    return "".join(code for code in params.order if _acts(code, params))


def in_order(params: SamplingParams) -> SamplingParams:
    """`params` with each sampler the order leaves out off (llama.cpp builds no sampler for it), so that the fast
    path, which reads the fields alone, runs the same chain; `params` itself where the order has every one on."""
    left_out = {code for code in _OFF if code not in params.order and _acts(code, params)}
    if not left_out:
        return params
    return replace(params, **{field: value for code in left_out for field, value in _OFF[code].items()})


# Each sampler's fields as llama.cpp's empty sampler leaves the candidates (SamplingParams' defaults, T 1).
_OFF = {"s": {"top_n_sigma": -1.0}, "k": {"top_k": 0}, "y": {"typical_p": 1.0}, "p": {"top_p": 1.0},
        "m": {"min_p": 0.0}, "x": {"xtc_probability": 0.0}, "t": {"temperature": 1.0, "dynatemp_range": 0.0},
        "i": {"infill": None}}


def _acts(code: str, p: SamplingParams) -> bool:
    return {"s": p.top_n_sigma > 0, "k": p.top_k > 0, "y": p.typical_p < 1, "p": p.top_p < 1, "m": p.min_p > 0,
            "x": p.xtc_probability > 0 and p.xtc_threshold <= MAX_THRESHOLD,
            "t": p.temperature != 1 or p.dynatemp_range > 0, "i": p.infill is not None}[code]


def truncation_temperature(params: SamplingParams) -> float | None:
    """The temperature at which the fast path (duo.sampling.distributions) reads the truncations' probabilities where
    it runs the order exactly, None where it cannot (then `chained`).

    The fast path runs top-n-sigma, top-k, typical, top-p, min-p and xtc in that turn, then the temperature (with
    dynatemp) and infill. An order runs so where its active steps, each at most once, keep that turn, and the
    temperature comes after the truncations (they read the temperature-1 probabilities: llama.cpp's default) or,
    without dynatemp (which reads the entropy where it stands), before them all (they read it at T: OpenAI's order).
    """
    steps = active_steps(params)
    cuts = [code for code in steps if code in _TRUNCATIONS]
    if len(set(steps)) != len(steps) or cuts != sorted(cuts, key=_TRUNCATIONS.index):
        return None
    if "i" in steps and steps[-1] != "i":
        return None
    if "t" not in steps:
        return 1.0
    if steps.index("t") == 0 and params.dynatemp_range == 0:  # before every truncation, or there is none
        return params.temperature
    return 1.0 if steps.index("t") == len(cuts) else None  # after every truncation, or between two


@dataclass
class _Branch:
    """The candidates one outcome of the chain's random steps leaves (XTC's cut fired or not), ranked."""

    weight: float  # the outcome's probability
    ids: np.ndarray  # [n] int64, ranked by `logits` (ties: lower id first)
    logits: np.ndarray  # [n] float64: the candidates' logits as the steps so far left them (scaled by temperature)


def chained(row: np.ndarray, params: SamplingParams) -> tuple[list[float], list[np.ndarray], list[np.ndarray]]:
    """The chain of params.order run step by step on `row` (its top logit finite; not greedy, not mirostat): each
    outcome's probability, ids and final probabilities (softmax of its candidates' logits).

    Each step reads the candidates as the steps before it left them, as llama.cpp's samplers do: a truncation after
    the temperature reads the probabilities at T, one before it at 1. XTC's random cut splits the chain into the
    outcome where it fired and the one where it did not. Slower than the fast path (one ranking of the vocabulary
    where no top-k comes first): it runs only for orders the fast path cannot (truncation_temperature None).
    """
    steps = active_steps(params)
    finite = int(np.count_nonzero(row > -np.inf))
    start = min(params.top_k, finite) if steps.startswith("k") else finite
    ids = leading_ids(row, start)
    branches = [_Branch(1.0, ids, row[ids].astype(np.float64))]
    for code in steps:
        branches = [after for branch in branches for after in _step(code, branch, params, row)]
    finals = [_probs(branch.logits) for branch in branches]
    return ([b.weight for b in branches], [b.ids[p > 0] for b, p in zip(branches, finals)],
            [p[p > 0] for p in finals])


def _step(code: str, b: _Branch, params: SamplingParams, row: np.ndarray) -> list[_Branch]:
    """One step of the chain on branch `b`: the branches after it (two where XTC's cut can fire)."""
    keep_min = params.min_keep
    if code == "x":
        removed = xtc_removed(b.ids, _probs(b.logits), params.xtc_threshold, keep_min)
        if not removed.size:
            return [b]
        stay = np.delete(np.arange(b.ids.size), removed)
        fired = params.xtc_probability
        return [_Branch(b.weight * (1 - fired), b.ids, b.logits),
                _Branch(b.weight * fired, b.ids[stay], b.logits[stay])]
    if code == "s" and b.ids.size > 1:
        n = int(np.count_nonzero(b.logits >= b.logits[0] - params.top_n_sigma * b.logits.std()))  # a prefix
    elif code == "k":
        n = min(params.top_k, b.ids.size)
    elif code == "y":
        return [_masked(b, typical_keep(_probs(b.logits), params.typical_p, keep_min))]
    elif code == "p":
        weights = _weights(b.logits)
        n = nucleus_size(weights, weights.sum(), params.top_p, keep_min)
    elif code == "m":
        n = min_p_size(_weights(b.logits), params.min_p, keep_min)
    elif code == "t":
        return [_tempered(b, params)]
    elif code == "i":
        return [_infilled(b, params, row)]
    else:
        n = b.ids.size
    return [_Branch(b.weight, b.ids[:n], b.logits[:n])]


def _masked(b: _Branch, keep: np.ndarray) -> _Branch:
    return _Branch(b.weight, b.ids[keep], b.logits[keep])  # a mask keeps the ranking


def _tempered(b: _Branch, params: SamplingParams) -> _Branch:
    """llama.cpp's temperature step (temp-ext): the logits divided by T, or by dynatemp's T_dyn from the entropy of
    the candidates as they stand; a temperature of 0 keeps the top candidate alone."""
    t = params.temperature
    if params.dynatemp_range > 0:
        if b.ids.size <= 1:
            return b
        t = dynamic_temperature(b.logits, params.temperature, params.dynatemp_range, params.dynatemp_exponent)
    if t <= 0:
        return _Branch(b.weight, b.ids[:1], b.logits[:1])
    return _Branch(b.weight, b.ids, b.logits / t)


def _infilled(b: _Branch, params: SamplingParams, row: np.ndarray) -> _Branch:
    """The infill step (ops.infill) on the candidates' probabilities; its survivors keep their probabilities before
    it, renormalised, so their log is the logits the steps after it read."""
    if b.ids.size <= 1:
        return b
    ids, probs = infill(b.ids, _probs(b.logits), params.infill, row)  # type: ignore[arg-type]
    logits = np.log(probs)
    order = np.lexsort((ids, -logits))
    return _Branch(b.weight, ids[order], logits[order])


def _weights(logits: np.ndarray) -> np.ndarray:
    """exp(l - max) of ranked logits: the top candidate weighs exactly 1."""
    return np.exp(logits - logits[0])


def _probs(logits: np.ndarray) -> np.ndarray:
    weights = _weights(logits)
    return weights / weights.sum()
