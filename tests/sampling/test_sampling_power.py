"""The end-to-end sampling check has teeth: speculative sampling with the real tiny pair, in process,
through tests/helpers/exact_fit.py, the same check test_duo applies to duo's own output. The real verifier
passes; realistic bugs fail it: the draft's distributions shifted by one position, the recovered token
drawn from p instead of the residual, and draft tokens accepted without checking (q ignored)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pytest

from duo.llama.model import Model
from duo.sampling.distributions import SparseDist, distribution, sample
from duo.sampling.params import SamplingParams
from duo.sampling.verification import Verdict, verify_stochastic
from helpers.exact_fit import first_two_p_values
from helpers.stats import verify_resampling_from_p

T1 = SamplingParams(temperature=1.0)
DRAFT_Q = SamplingParams(temperature=1.0, top_k=10)  # duo-draft's default --top-k-cap
PROMPT = "Once upon a time"
SAMPLES, DRAFTED = 300, 4
# The threshold test_duo uses: a correct sampler fails it once in 5000 runs; the bugs below gave
# p-values of 1e-5 to 1e-7 (recovered from p) and far less (the others) at this many samples.
SIGNIFICANCE = 1e-4

Verifier = Callable[[Sequence[int], Sequence[SparseDist], np.ndarray, SamplingParams, np.random.Generator], Verdict]


def shifted_by_one(drafts, dists, rows, params, rng) -> Verdict:
    """Each draft token judged against the next position's q (an off-by-one in the chain's bookkeeping)."""
    return verify_stochastic(drafts, list(dists[1:]) + list(dists[-1:]), rows, params, rng)


def accepting_unchecked(drafts, dists, rows, params, rng) -> Verdict:
    """q ignored: every draft token accepted as if the target had drawn it."""
    return Verdict(len(drafts), list(drafts) + [sample(distribution(rows[-1], params), rng)])


def speculative_samples(target: Model, draft: Model, verifier: Verifier, n: int, seed: int) -> list[list[int]]:
    """n two-token continuations of PROMPT: the draft samples DRAFTED tokens from its top-10 q, the target
    verifies them in one batch (rows for each position and the bonus), until two tokens are committed."""
    rng = np.random.default_rng(seed)
    prompt = target.tokenize(PROMPT)
    target_context, draft_context = target.new_context(64), draft.new_context(64)
    samples = []
    try:
        for _ in range(n):
            out: list[int] = []
            while len(out) < 2:
                draft_context.rollback(0)
                logits = draft_context.decode([*prompt, *out], 0)[-1]
                drafts, dists = [], []
                for _ in range(DRAFTED):
                    q = distribution(logits, DRAFT_Q)
                    drafts.append(sample(q, rng))
                    dists.append(q)
                    logits = draft_context.decode([drafts[-1]], draft_context.n_past)[-1]
                target_context.rollback(0)
                held = len(prompt) + len(out)
                rows = target_context.decode([*prompt, *out, *drafts], 0, logits_for=range(held - 1, held + DRAFTED))
                out += verifier(drafts, dists, rows, T1, rng).tokens
            samples.append(out[:2])
    finally:
        target_context.close()
        draft_context.close()
    return samples


def test_the_exact_fit_passes_speculative_sampling_done_right(target_model, draft_model):
    samples = speculative_samples(target_model, draft_model, verify_stochastic, SAMPLES, seed=1)
    assert len({tuple(s) for s in samples}) > 20  # the samples vary: the test is not trivially passed
    assert min(first_two_p_values(target_model, target_model.tokenize(PROMPT), samples, T1)) > SIGNIFICANCE


@pytest.mark.parametrize("broken", [shifted_by_one, verify_resampling_from_p, accepting_unchecked],
                         ids=["q shifted by one position", "recovered from p, not the residual", "q ignored"])
def test_the_exact_fit_catches_a_broken_verifier(target_model, draft_model, broken):
    samples = speculative_samples(target_model, draft_model, broken, SAMPLES, seed=1)
    assert min(first_two_p_values(target_model, target_model.tokenize(PROMPT), samples, T1)) < SIGNIFICANCE
