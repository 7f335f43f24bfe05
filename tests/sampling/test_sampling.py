"""Specification of duo.sampling: truncated distributions, sampling, and lossless verification."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
from scipy.stats import chisquare

from duo.sampling import coupled, distributions, verification
from duo.sampling.distributions import SparseDist, distribution, sample
from duo.sampling.params import SamplingParams
from duo.sampling.verification import Verdict, verify, verify_greedy, verify_stochastic
from helpers.stats import (ALPHA, P_TARGET, TRIALS, chi_square_pvalue, dense, first_token_trials, normalised,
                           probs_to_logits, verify_resampling_from_p)

QWEN_VOCAB = 151936
PLAIN = SamplingParams(temperature=1.0)  # plain softmax sampling, no truncation


def reference_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Naive dense reference: full stable sort (ties: lower id first), then each filter in turn at temperature 1,
    then the temperature over what is left (llama.cpp's default chain)."""
    out = np.zeros(logits.size)
    if params.greedy:
        out[np.argmax(logits)] = 1.0
        return out
    probs = normalised(np.exp(logits.astype(np.float64) - logits.max()))
    kept = np.argsort(-logits, kind="stable")
    if params.top_k:
        kept = kept[: params.top_k]
    p = normalised(probs[kept])
    if params.top_p < 1:
        reached = np.cumsum(p) >= params.top_p
        n = int(np.argmax(reached)) + 1 if reached.any() else p.size
        kept, p = kept[:n], normalised(p[:n])
    if params.min_p > 0:
        keep = p >= params.min_p * p.max()
        kept, p = kept[keep], normalised(p[keep])
    out[kept] = normalised(np.exp((logits[kept].astype(np.float64) - logits[kept].max()) / params.temperature))
    return out


# --- SamplingParams.validate ---------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=2.0, top_k=1, top_p=1.0, min_p=0.0),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1e-3, top_k=np.int64(5), top_p=np.float32(0.5), min_p=0.999),
    ],
)
def test_validate_accepts_values_in_range(params: SamplingParams) -> None:
    params.validate()


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", 3.5),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "1"),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", float("nan")),
        ("min_p", -0.1),
        ("min_p", 1.0),
        ("min_p", float("nan")),
    ],
)
def test_validate_rejects_out_of_range_value_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be .*got {re.escape(repr(value))}$"):
        SamplingParams(**{field: value}).validate()


def test_validate_message_says_what_to_fix() -> None:
    with pytest.raises(ValueError, match="temperature must be between 0 and 2 .*got 3.5"):
        SamplingParams(temperature=3.5).validate()


def test_greedy_means_temperature_zero() -> None:
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_distribution_validates_params() -> None:
    with pytest.raises(ValueError, match="top_p"):
        distribution(np.zeros(4, np.float32), SamplingParams(temperature=1.0, top_p=0.0))


# --- distribution ----------------------------------------------------------------------


def test_greedy_distribution_is_one_hot_on_the_argmax() -> None:
    d = distribution(np.array([0.1, 2.0, -1.0, 1.9], np.float32), SamplingParams())
    assert d.ids.tolist() == [1] and d.probs.tolist() == [1.0]


def test_greedy_ties_go_to_the_lowest_id() -> None:
    d = distribution(np.array([0.0, 3.0, 1.0, 3.0], np.float32), SamplingParams())
    assert d.ids.tolist() == [1]


def test_temperature_scales_logits_before_softmax() -> None:
    d = distribution(np.array([0.0, 1.0, 2.0], np.float32), SamplingParams(temperature=0.5))
    e = np.e
    by_hand = np.array([1, e**2, e**4]) / (1 + e**2 + e**4)  # softmax of [0, 2, 4]
    np.testing.assert_allclose(dense(d, 3), by_hand, rtol=1e-12)


def test_untruncated_support_is_the_vocab_in_id_order_with_probs_summing_to_one() -> None:
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    d = distribution(logits, PLAIN)
    assert d.ids.dtype == np.int64 and d.probs.dtype == np.float64
    assert d.ids.tolist() == list(range(1000))  # no ranking: nothing was cut
    assert np.all(d.probs > 0)
    assert d.probs.sum() == pytest.approx(1.0, abs=1e-12)


def test_truncated_ids_are_most_probable_first() -> None:
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    d = distribution(logits, SamplingParams(temperature=1.0, top_p=0.9))
    assert np.all(np.diff(d.probs) <= 0) and np.all(d.probs > 0)


def test_top_k_keeps_exactly_the_k_most_probable() -> None:
    logits = np.array([0.3, 2.0, -1.0, 1.5, 0.9, 1.7], np.float32)
    d = distribution(logits, SamplingParams(temperature=1.0, top_k=3))
    assert d.ids.tolist() == [1, 5, 3]
    kept = np.exp(logits[[1, 5, 3]].astype(np.float64))
    np.testing.assert_allclose(d.probs, normalised(kept), rtol=1e-12)


def test_top_k_breaks_ties_at_the_cut_towards_lower_ids() -> None:
    logits = np.array([1.0, 5.0, 1.0, 1.0, 0.0], np.float32)
    d = distribution(logits, SamplingParams(temperature=1.0, top_k=3))
    assert d.ids.tolist() == [1, 0, 2]


def test_top_k_at_or_above_the_vocabulary_size_keeps_everything() -> None:
    d = distribution(np.arange(5, dtype=np.float32), SamplingParams(temperature=1.0, top_k=99))
    assert d.ids.size == 5


@pytest.mark.parametrize("top_p, kept", [(0.4, 1), (0.75, 2), (0.85, 3), (0.99, 4)])
def test_top_p_keeps_the_smallest_nucleus_reaching_top_p(top_p: float, kept: int) -> None:
    probs = [0.05, 0.5, 0.15, 0.3]
    d = distribution(probs_to_logits(probs), SamplingParams(temperature=1.0, top_p=top_p))
    assert d.ids.tolist() == [1, 3, 2, 0][:kept]
    np.testing.assert_allclose(d.probs, normalised(np.array(probs)[d.ids]), rtol=1e-6)


@pytest.mark.parametrize("min_p, kept", [(0.05, 4), (0.2, 3), (0.5, 2), (0.7, 1)])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p: float, kept: int) -> None:
    probs = [0.05, 0.5, 0.15, 0.3]  # thresholds: 0.025, 0.1, 0.25, 0.35
    d = distribution(probs_to_logits(probs), SamplingParams(temperature=1.0, min_p=min_p))
    assert d.ids.tolist() == [1, 3, 2, 0][:kept]
    np.testing.assert_allclose(d.probs, normalised(np.array(probs)[d.ids]), rtol=1e-6)


def test_filters_read_temperature_one_and_the_temperature_comes_last_by_default() -> None:
    # llama.cpp's default chain: top-k=3 keeps [.4, .3, .2] / .9; top-p=0.9 needs all three (.778 < .9); min-p=0.3
    # keeps .2 (>= .3 * .4 / .9); then T=0.5 squares what is left: [.16, .09, .04] / .29.
    logits = probs_to_logits([0.1, 0.4, 0.2, 0.3, 0.0])
    d = distribution(logits, SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.3))
    assert d.ids.tolist() == [1, 3, 2]
    np.testing.assert_allclose(d.probs, np.array([0.16, 0.09, 0.04]) / 0.29, rtol=1e-6)


def test_filters_read_the_tempered_probabilities_where_the_order_puts_the_temperature_first() -> None:
    # samplers "tkpm" (OpenAI's and vLLM's order): at T=0.5 the probabilities square: [.4, .3, .2, .1] ->
    # [.16, .09, .04, .01] / .30. top-k=3 keeps [.16, .09, .04] / .29; top-p=0.9 needs all three (.862 < .9);
    # min-p=0.3 drops .04 (< .3 * .16 = .048), leaving [.16, .09] / .25.
    logits = probs_to_logits([0.1, 0.4, 0.2, 0.3, 0.0])
    d = distribution(logits, SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.3, order="tkpm"))
    assert d.ids.tolist() == [1, 3]
    np.testing.assert_allclose(d.probs, [0.64, 0.36], rtol=1e-6)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=1e-9),
        SamplingParams(temperature=1.0, min_p=0.999),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1e-4, top_p=0.5, min_p=0.9),
    ],
)
def test_at_least_one_token_is_always_kept(params: SamplingParams) -> None:
    d = distribution(np.array([1.0, 0.9, 0.5], np.float32), params)
    assert d.ids.tolist() == [0] and d.probs.tolist() == [1.0]


def test_minus_inf_logits_get_no_probability() -> None:
    d = distribution(np.array([-np.inf, 0.0, -np.inf, 1.0], np.float32), PLAIN)
    assert sorted(d.ids.tolist()) == [1, 3]


@pytest.mark.parametrize("bad", [[0.0, np.nan, 1.0], [0.0, np.inf]])
@pytest.mark.parametrize("params", [SamplingParams(), PLAIN])
def test_nan_or_inf_logits_are_rejected(bad: list, params: SamplingParams) -> None:
    with pytest.raises(ValueError, match="logits"):
        distribution(np.array(bad, np.float32), params)


@pytest.mark.parametrize("choose", [
    lambda rows: distribution(rows[0], SamplingParams()),
    lambda rows: distribution(rows[0], SamplingParams(temperature=1.0, top_k=2)),
    lambda rows: verify_greedy([1], rows),
    lambda rows: verify([1], None, rows, PLAIN, np.random.default_rng(0), coupled_seed=5),
    lambda rows: verify_stochastic([1], [SparseDist.point(1)], rows, PLAIN, np.random.default_rng(0)),
], ids=["greedy distribution", "truncated distribution", "greedy verification", "coupled", "residual"])
def test_a_row_whose_every_token_is_banned_raises_no_token_allowed_saying_what_to_fix(choose) -> None:
    rows = np.full((2, 4), -np.inf, np.float32)
    with pytest.raises(distributions.NoTokenAllowed, match="logit_bias and grammar leave no token allowed"):
        choose(rows)


def test_log_probs_list_only_the_tokens_the_row_allows() -> None:
    row = np.array([-np.inf, 2.0, -np.inf, 1.0, -np.inf], np.float32)  # a grammar's mask, logit_bias false
    logprob, top = distributions.log_probs(row, 1, 5)
    assert [token for token, _ in top] == [1, 3] and logprob == top[0][1]
    assert all(np.isfinite(value) for _, value in top)


@pytest.mark.parametrize("shape", [(0,), (2, 3)])
def test_logits_must_be_a_non_empty_vector(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="1-D"):
        distribution(np.zeros(shape, np.float32), PLAIN)


def _qwen_sized_logits() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    flat = rng.standard_normal(QWEN_VOCAB).astype(np.float32)
    peaked = (2 * rng.standard_normal(QWEN_VOCAB)).astype(np.float32)
    peaked[rng.choice(QWEN_VOCAB, 20, replace=False)] += np.linspace(8, 18, 20, dtype=np.float32)
    tied = np.round(4 * rng.standard_normal(QWEN_VOCAB)).astype(np.float32) / 2  # long runs of ties
    masked = peaked.copy()
    masked[rng.random(QWEN_VOCAB) < 0.5] = -np.inf
    return {"flat": flat, "peaked": peaked, "tied": tied, "masked": masked}


QWEN_LOGITS = _qwen_sized_logits()
PARAM_COMBOS = [
    SamplingParams(),
    PLAIN,
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=1.0, top_k=40),
    SamplingParams(temperature=1.7, top_k=5000),
    SamplingParams(temperature=1.0, top_p=0.95),
    SamplingParams(temperature=0.6, top_p=0.5),
    SamplingParams(temperature=2.0, top_p=0.3),  # nucleus beyond the first candidate round
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=1e-6),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
    SamplingParams(temperature=0.8, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.2, top_k=2000, top_p=0.7, min_p=0.001),
    SamplingParams(temperature=1.0, top_k=QWEN_VOCAB),
]


@pytest.mark.parametrize("name", QWEN_LOGITS)
def test_fast_path_agrees_with_naive_full_sort_reference_on_a_qwen_sized_vocab(name: str) -> None:
    logits = QWEN_LOGITS[name]
    for params in PARAM_COMBOS:
        d = distribution(logits, params)
        expected = reference_distribution(logits, params)
        assert set(d.ids.tolist()) == set(np.flatnonzero(expected).tolist()), params
        np.testing.assert_allclose(dense(d, QWEN_VOCAB), expected, atol=1e-9, err_msg=str(params))
        truncated = params.greedy or 0 < params.top_k < QWEN_VOCAB or params.top_p < 1 or params.min_p > 0
        assert not truncated or np.all(np.diff(d.probs) <= 0), params


# --- SparseDist, sample, dense ---------------------------------------------------------


def test_sparse_dist_coerces_to_int64_ids_and_float64_probs() -> None:
    d = SparseDist([3, 1], [0.75, 0.25])
    assert d.ids.dtype == np.int64 and d.probs.dtype == np.float64


@pytest.mark.parametrize("ids, probs", [([1, 2], [1.0]), ([], []), ([[1]], [[1.0]])])
def test_sparse_dist_rejects_mismatched_or_empty_arrays(ids: list, probs: list) -> None:
    with pytest.raises(ValueError, match="SparseDist"):
        SparseDist(ids, probs)


def test_sample_draws_ids_with_their_probabilities() -> None:
    d = SparseDist([7, 2, 9], [0.6, 0.3, 0.1])
    rng = np.random.default_rng(0)
    draws = [sample(d, rng) for _ in range(20_000)]
    assert all(type(t) is int for t in draws[:10])
    counts = np.array([draws.count(t) for t in (7, 2, 9)])
    assert counts.sum() == len(draws)  # nothing outside the support
    assert chisquare(counts, len(draws) * d.probs).pvalue > ALPHA


def test_dense_places_probs_and_drops_ids_outside_the_vocabulary() -> None:
    d = SparseDist([4, 0, 6], [0.5, 0.3, 0.2])
    # id 6 >= 5 is dropped, not renormalised: dense(q)[i] stays q(i)
    np.testing.assert_array_equal(dense(d, 5), [0.3, 0, 0, 0, 0.5])


# --- verify_greedy ---------------------------------------------------------------------


def one_hot_rows(best: list[int], n_vocab: int = 10) -> np.ndarray:
    """Target logits whose row i has its argmax at best[i]."""
    rows = np.zeros((len(best), n_vocab), np.float32)
    rows[np.arange(len(best)), np.asarray(best, dtype=np.int64)] = 1.0
    return rows


def test_greedy_accepts_all_matching_drafts_and_adds_the_bonus_argmax() -> None:
    assert verify_greedy([3, 1, 4], one_hot_rows([3, 1, 4, 5])) == Verdict(3, [3, 1, 4, 5])


def test_greedy_stops_at_the_first_mismatch_with_the_recovered_argmax() -> None:
    assert verify_greedy([3, 1, 4], one_hot_rows([3, 2, 4, 5])) == Verdict(1, [3, 2])
    assert verify_greedy([3, 1, 4], one_hot_rows([0, 1, 4, 5])) == Verdict(0, [0])


def test_greedy_without_a_bonus_row_emits_just_the_accepted_drafts() -> None:
    assert verify_greedy([3, 1], one_hot_rows([3, 1])) == Verdict(2, [3, 1])
    assert verify_greedy([3, 1], one_hot_rows([3, 7])) == Verdict(1, [3, 7])


def test_greedy_with_no_drafts() -> None:
    assert verify_greedy([], np.zeros((0, 10), np.float32)) == Verdict(0, [])
    assert verify_greedy([], one_hot_rows([6])) == Verdict(0, [6])


@pytest.mark.parametrize("shape", [(4, 10), (1, 10), (10,), (3, 1, 10)])
def test_greedy_rejects_logits_whose_rows_do_not_fit_the_chain(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="target_logits must have shape"):
        verify_greedy([1, 2], np.zeros(shape, np.float32))


def test_greedy_rejects_draft_ids_outside_the_target_vocabulary() -> None:
    rows = one_hot_rows([3, 1])  # 10 target tokens; the draft vocabulary may be larger
    assert verify_greedy([10, 1], rows) == Verdict(0, [3])
    assert verify_greedy([3, 137], rows) == Verdict(1, [3, 1])


def test_greedy_outputs_python_ints() -> None:
    verdict = verify_greedy(np.array([3, 1]), one_hot_rows([3, 1, 4]))
    assert all(type(t) is int for t in verdict.tokens) and type(verdict.n_accepted) is int


# --- verify (dispatch) and verify_stochastic structure --------------------------------


def test_verify_dispatches_greedy_params_to_greedy_verification_without_draft_dists() -> None:
    rng = np.random.default_rng(0)
    verdict = verify([3, 1], None, one_hot_rows([3, 2, 4]), SamplingParams(), rng)
    assert verdict == Verdict(1, [3, 2])


def test_verify_needs_draft_dists_when_sampling() -> None:
    with pytest.raises(ValueError, match="draft distributions"):
        verify([3], None, one_hot_rows([3, 4]), PLAIN, np.random.default_rng(0))


def test_stochastic_needs_one_draft_dist_per_draft_token() -> None:
    qs = [SparseDist([3], [1.0])]
    with pytest.raises(ValueError, match="1 draft distributions for 2 draft tokens"):
        verify_stochastic([3, 1], qs, one_hot_rows([3, 1]), PLAIN, np.random.default_rng(0))


def test_stochastic_rejects_logits_whose_rows_do_not_fit_the_chain() -> None:
    qs = [SparseDist([3], [1.0])]
    with pytest.raises(ValueError, match="target_logits must have shape"):
        verify_stochastic([3], qs, one_hot_rows([3, 1, 4]), PLAIN, np.random.default_rng(0))


# With top_k=1 the target is one-hot on its argmax, so acceptance is deterministic.
ONE_HOT_TARGET = SamplingParams(temperature=1.0, top_k=1)


def verify_one_hot(drafts: list[int], qs: list[SparseDist], best: list[int]) -> Verdict:
    rng = np.random.default_rng(0)
    return verify_stochastic(drafts, qs, one_hot_rows(best), ONE_HOT_TARGET, rng)


def test_stochastic_accepts_a_certain_chain_and_samples_the_bonus() -> None:
    qs = [SparseDist([3, 0], [0.9, 0.1]), SparseDist([1, 0], [0.5, 0.5])]
    verdict = verify_one_hot([3, 1], qs, [3, 1, 4])
    assert verdict == Verdict(2, [3, 1, 4])
    assert all(type(t) is int for t in verdict.tokens)


def test_stochastic_without_a_bonus_row_emits_just_the_accepted_drafts() -> None:
    qs = [SparseDist([3], [1.0]), SparseDist([1], [1.0])]
    assert verify_one_hot([3, 1], qs, [3, 1]) == Verdict(2, [3, 1])


def test_stochastic_with_no_drafts() -> None:
    assert verify_one_hot([], [], []) == Verdict(0, [])
    assert verify_one_hot([], [], [6]) == Verdict(0, [6])


def test_stochastic_rejects_draft_ids_outside_the_target_vocabulary() -> None:
    # Token 12 has p = 0 for a 10-token target, however much the draft believed in it.
    q = SparseDist([12, 3], [0.99, 0.01])
    rng = np.random.default_rng(0)
    for _ in range(50):
        verdict = verify_stochastic([12], [q], np.zeros((2, 10), np.float32), PLAIN, rng)
        assert verdict.n_accepted == 0 and len(verdict.tokens) == 1
        assert 0 <= verdict.tokens[0] < 10


def test_stochastic_never_reads_rows_after_the_first_rejection() -> None:
    rows = one_hot_rows([3, 1, 4])
    rows[1:] = np.nan  # distribution() raises on NaN rows, so reading one would fail
    qs = [SparseDist([5], [1.0]), SparseDist([1], [1.0])]
    verdict = verify_stochastic([5, 1], qs, rows, ONE_HOT_TARGET, np.random.default_rng(0))
    assert verdict == Verdict(0, [3])


# --- stochastic verification preserves the target distribution (statistical) ----------

VOCAB = 8
P_WITH_ZEROS = [0.40, 0.0, 0.25, 0.0, 0.20, 0.15, 0.0, 0.0]
# (target p, draft q) pairs. q may name ids past the target vocabulary (8, 9 below):
# the draft's vocabulary can be larger than the target's.
Q_CASES = {
    "q close to p": (
        P_TARGET,
        SparseDist(range(8), [0.28, 0.22, 0.14, 0.13, 0.09, 0.08, 0.04, 0.02]),
    ),
    "q very different from p": (
        P_TARGET,
        SparseDist(range(8), [0.02, 0.03, 0.05, 0.10, 0.15, 0.20, 0.20, 0.25]),
    ),
    "q puts mass where p has none": (
        P_WITH_ZEROS,
        SparseDist(
            [1, 3, 6, 7, 9, 0, 2, 4, 5, 8],
            [0.2, 0.15, 0.1, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05],
        ),
    ),
    "q misses tokens p has": (P_TARGET, SparseDist([5, 6, 7], [0.5, 0.3, 0.2])),
}


@functools.cache
def verified_q_case(case: str) -> tuple[np.ndarray, int]:
    """first_token_trials of the real verifier on a Q_CASES entry (cached: two tests use it)."""
    p_probs, q = Q_CASES[case]
    return first_token_trials(verify_stochastic, probs_to_logits(p_probs), q, PLAIN)


@pytest.mark.parametrize("case", Q_CASES)
def test_first_emitted_token_follows_the_target_distribution(case: str) -> None:
    counts, _ = verified_q_case(case)
    assert chi_square_pvalue(counts, np.array(Q_CASES[case][0])) > ALPHA


TARGET_LOGITS_WIDE = probs_to_logits([0.22, 0.18, 0.15, 0.13, 0.11, 0.09, 0.07, 0.05])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.3, top_k=6, top_p=0.8, min_p=0.3),
    ],
    ids=["top_k", "top_k top_p min_p"],
)
def test_first_emitted_token_follows_the_truncated_target(params: SamplingParams) -> None:
    # The draft proposes from the untruncated distribution, so it often drafts tokens the
    # truncated target gives zero probability: those must all be rejected.
    q = distribution(TARGET_LOGITS_WIDE, PLAIN)
    counts, _ = first_token_trials(verify_stochastic, TARGET_LOGITS_WIDE, q, params)
    assert chi_square_pvalue(counts, reference_distribution(TARGET_LOGITS_WIDE, params)) > ALPHA


def test_draft_token_outside_its_own_distribution_is_replaced_by_a_fresh_target_sample() -> None:
    # A buggy draft claims q but sends a token q gives zero probability. The accept/residual
    # pair assumes x ~ q, so the verifier discards x and samples p outright: still exactly p.
    q = SparseDist([0, 1], [0.6, 0.4])
    rng = np.random.default_rng(0)
    rows = probs_to_logits(P_TARGET)[None, :]
    counts = np.zeros(VOCAB, dtype=np.int64)
    for _ in range(TRIALS // 4):
        outside_q = int(rng.integers(2, VOCAB))
        verdict = verify_stochastic([outside_q], [q], rows, PLAIN, rng)
        assert verdict.n_accepted == 0
        counts[verdict.tokens[0]] += 1
    assert chi_square_pvalue(counts, np.array(P_TARGET)) > ALPHA


# Two positions over a 6-token vocabulary. The target's second row depends on the first
# token (SECOND_LOGITS[first]), and so does the draft's second distribution.
CHAIN_VOCAB = 6
CHAIN_PARAMS = SamplingParams(temperature=0.9)
_chain_rng = np.random.default_rng(42)
FIRST_LOGITS = _chain_rng.normal(0, 0.8, CHAIN_VOCAB).astype(np.float32)
SECOND_LOGITS = _chain_rng.normal(0, 0.8, (CHAIN_VOCAB, CHAIN_VOCAB)).astype(np.float32)
_draft_noise = _chain_rng.normal(0, 0.7, CHAIN_VOCAB).astype(np.float32)
DRAFT_FIRST = distribution(FIRST_LOGITS + _draft_noise, PLAIN)
DRAFT_SECOND = [distribution(row, PLAIN) for row in SECOND_LOGITS[::-1]]  # deliberately mismatched


@pytest.mark.parametrize(
    "drafted", [2, 1], ids=["two drafted tokens", "one drafted token and the bonus"]
)
def test_first_two_emitted_tokens_follow_the_target_joint_distribution(drafted: int) -> None:
    rng = np.random.default_rng(7)
    counts = np.zeros((CHAIN_VOCAB, CHAIN_VOCAB), dtype=np.int64)
    for _ in range(TRIALS):
        x1 = sample(DRAFT_FIRST, rng)
        x2 = sample(DRAFT_SECOND[x1], rng)
        # Row 2 is conditioned on x1; it is only read when x1 is accepted, i.e. is the first token.
        rows = np.stack([FIRST_LOGITS, SECOND_LOGITS[x1]])
        drafts, qs = [x1, x2][:drafted], [DRAFT_FIRST, DRAFT_SECOND[x1]][:drafted]
        tokens = verify_stochastic(drafts, qs, rows, CHAIN_PARAMS, rng).tokens
        if len(tokens) == 1:  # x1 was rejected: the next round drafts after the recovered token
            first = tokens[0]
            x2 = sample(DRAFT_SECOND[first], rng)
            row = SECOND_LOGITS[first][None, :]
            tokens += verify_stochastic([x2], [DRAFT_SECOND[first]], row, CHAIN_PARAMS, rng).tokens
        counts[tokens[0], tokens[1]] += 1
    p1 = reference_distribution(FIRST_LOGITS, CHAIN_PARAMS)
    p2 = np.stack([reference_distribution(row, CHAIN_PARAMS) for row in SECOND_LOGITS])
    assert chi_square_pvalue(counts.ravel(), (p1[:, None] * p2).ravel()) > ALPHA


# --- the statistical harness has teeth -------------------------------------------------


def test_harness_rejects_a_verifier_that_resamples_from_p_instead_of_the_residual() -> None:
    # Emits min(p, q) + (1 - sum min(p, q)) p, which over-weights tokens where q > p.
    p_probs, q = Q_CASES["q very different from p"]
    counts, _ = first_token_trials(verify_resampling_from_p, probs_to_logits(p_probs), q, PLAIN)
    assert chi_square_pvalue(counts, np.array(p_probs)) < 1e-6


def test_acceptance_rate_is_the_overlap_of_p_and_q() -> None:
    p_probs, q = Q_CASES["q very different from p"]
    _, accepted = verified_q_case("q very different from p")
    overlap = np.minimum(np.array(p_probs), dense(q, VOCAB)).sum()  # 0.43
    sigma = np.sqrt(overlap * (1 - overlap) / TRIALS)
    assert abs(accepted / TRIALS - overlap) < 4 * sigma


def textbook_verify_stochastic(drafts: list[int], qs: list[SparseDist], rows: np.ndarray, params: SamplingParams,
                               rng: np.random.Generator) -> list[int]:
    """Speculative sampling written out with p over the whole vocabulary at every row (the reference)."""
    tokens = []
    for row, x, q in zip(rows, drafts, qs):
        p = distribution(row, params)
        p_x, q_x = float(dense(p, row.size + 1)[x]), float(dense(q, row.size + 1)[x])
        if q_x > 0 and rng.random() * q_x < p_x:
            tokens.append(x)
            continue
        return tokens + [verification._sample_residual(p, q, rng) if q_x > 0 else sample(p, rng)]
    if rows.shape[0] > len(drafts):
        tokens.append(sample(distribution(rows[-1], params), rng))
    return tokens


@pytest.mark.parametrize("cut", [coupled.RACE_CUT, 2.0, 0.3])  # small cuts: p(x) is seldom settled early
def test_rejection_sampling_decides_every_row_as_the_whole_distribution_would(monkeypatch, cut) -> None:
    monkeypatch.setattr(coupled, "RACE_CUT", cut)
    monkeypatch.setattr(coupled, "TAIL_WEIGHT", np.exp(-cut) * (1 + 1e-9))
    rng = np.random.default_rng(int(cut * 10))
    for trial in range(150):
        n_vocab = QWEN_VOCAB if trial % 15 == 0 else 2048
        rows = rng.standard_normal((4, n_vocab)) * rng.choice([0.5, 2.0])
        rows[:, :8] += rng.uniform(0, 8, size=(4, 8))  # a few likely tokens, as the draft would propose
        rows = rows.astype(rng.choice([np.float32, np.float64]))
        params = SamplingParams(temperature=float(rng.choice([0.3, 0.7, 1.0, 1.5])))
        qs = [SparseDist(np.arange(8), rng.dirichlet(np.ones(8))) for _ in range(3)]
        drafts = [int(rng.integers(9)) for _ in range(3)]  # 8: outside q, then p is sampled afresh
        ours = verify_stochastic(drafts, qs, rows, params, np.random.default_rng(trial))
        assert ours.tokens == textbook_verify_stochastic(drafts, qs, rows, params, np.random.default_rng(trial))
