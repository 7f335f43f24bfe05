"""llama.cpp's other samplers, exact under speculation: typical, top-n-sigma, dynatemp, xtc, min_keep and mirostat as
distributions (against loop-by-loop references of llama.cpp's samplers), then through the target's verification,
residual and coupled, with a draft whose q is deliberately different; DRY as a transform by the tokens before a row."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from scipy.stats import chisquare

from duo.draft.session import DraftSession, Slot, draw
from duo.sampling import verification
from duo.sampling.coupled import coupled_sample
from duo.sampling.distributions import SparseDist, distribution, sample
from duo.sampling.ops import dry
from duo.sampling.ops.dry import Dry, restart_sequences
from duo.sampling.ops.penalties import Penalties
from duo.sampling.params import SamplingParams
from duo.sampling.rows import transform
from duo.sampling.verification import verify_coupled, verify_stochastic

SIGNIFICANCE = 1e-4  # a correct sampler fails a fit once in 10000 runs; the broken ones below reach 1e-10 and less
TRIALS = 3000


def dense(dist: SparseDist, n_vocab: int) -> np.ndarray:
    out = np.zeros(n_vocab)
    out[dist.ids] = dist.probs
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    w = np.exp(x - x.max())
    return w / w.sum()


# --- References: llama.cpp's samplers as its loops read, on a ranked candidate list --------------------------------

def reference(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The dense distribution of top-n-sigma -> top-k -> typical -> top-p -> min-p -> xtc -> temperature (dynatemp),
    each step on the candidates left, written loop by loop from llama-sampling.cpp (its default chain: the
    temperature last)."""
    logit = logits.astype(np.float64)
    cand = sorted((i for i in range(logit.size) if logit[i] > -np.inf), key=lambda i: (-logit[i], i))
    probs = lambda c: softmax(logit[c])  # noqa: E731  (at temperature 1, over the candidates)
    if p.top_n_sigma > 0:
        finite = logit[logit > -np.inf]
        cand = [i for i in cand if logit[i] >= finite.max() - p.top_n_sigma * finite.std()]
    if p.top_k > 0:
        cand = cand[:p.top_k]
    if p.typical_p < 1:
        pr = probs(cand)
        entropy = -sum(q * math.log(q) for q in pr)
        order = sorted(range(len(cand)), key=lambda j: abs(-math.log(pr[j]) - entropy))
        total, kept = 0.0, []
        for n, j in enumerate(order):
            total += pr[j]
            kept.append(j)
            if total > p.typical_p and n + 1 >= p.min_keep:
                break
        cand = [cand[j] for j in sorted(kept)]
    if p.top_p < 1:
        pr, total = probs(cand), 0.0
        for n in range(len(cand)):
            total += pr[n]
            if total >= p.top_p and n + 1 >= p.min_keep:
                cand = cand[:n + 1]
                break
    if p.min_p > 0:
        pr = probs(cand)
        n = 1
        while n < len(cand) and (pr[n] >= p.min_p * pr[0] or n < p.min_keep):
            n += 1
        cand = cand[:n]
    out = _finished_reference(logit, cand, p)
    if p.xtc_probability > 0 and p.xtc_threshold <= 0.5 and len(cand) >= 2:
        pr, last = probs(cand), 0
        for n in range(len(cand)):
            if pr[n] < p.xtc_threshold:
                break
            last = n
        if last > 0 and len(cand) - last >= p.min_keep:
            out = (1 - p.xtc_probability) * out + p.xtc_probability * _finished_reference(logit, cand[last:], p)
    return out


def _finished_reference(logit: np.ndarray, cand: list[int], p: SamplingParams) -> np.ndarray:
    out = np.zeros(logit.size)
    t = p.temperature
    if p.dynatemp_range > 0 and len(cand) > 1:
        pr = softmax(logit[cand])
        entropy = -sum(q * math.log(q) for q in pr if q > 0)
        low, high = max(0.0, t - p.dynatemp_range), t + p.dynatemp_range
        t = low + (high - low) * (entropy / math.log(len(cand))) ** p.dynatemp_exponent
    out[cand] = softmax(logit[cand] / t)
    return out


SAMPLERS = {
    "typical": SamplingParams(temperature=0.9, typical_p=0.6),
    "typical, min_keep": SamplingParams(temperature=1.0, typical_p=0.2, min_keep=4),
    "top_n_sigma": SamplingParams(temperature=1.3, top_n_sigma=1.0),
    "dynatemp": SamplingParams(temperature=0.8, dynatemp_range=0.6, dynatemp_exponent=1.5),
    "xtc": SamplingParams(temperature=1.0, xtc_probability=0.7, xtc_threshold=0.1),
    "xtc, min_keep": SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.05, min_keep=9),
    "top_p, min_p, min_keep": SamplingParams(temperature=1.0, top_p=0.3, min_p=0.5, min_keep=3),
    "all of them": SamplingParams(temperature=0.7, top_k=10, typical_p=0.95, top_p=0.9, min_p=0.02,
                                  top_n_sigma=2.0, xtc_probability=0.4, xtc_threshold=0.08, dynatemp_range=0.3),
}


@pytest.mark.parametrize("params", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_each_sampler_gives_llama_cpps_distribution(params):
    rng = np.random.default_rng(7)
    for _ in range(20):
        logits = rng.normal(0, 2.5, 40).astype(np.float32)
        logits[rng.integers(0, 40)] = -np.inf  # a banned token has no say, not even in sigma's spread
        assert np.allclose(dense(distribution(logits, params), 40), reference(logits, params), atol=1e-9)


def test_xtc_is_the_mixture_of_the_cut_and_the_uncut_row():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    dist = dense(distribution(logits, SamplingParams(temperature=1.0, xtc_probability=0.25, xtc_threshold=0.15)), 4)
    cut = np.array([0, 0, 2 / 3, 1 / 3])  # 0.4 and 0.3 leave, 0.2 (the least likely above 0.15) stays
    assert np.allclose(dist, 0.75 * np.array([0.4, 0.3, 0.2, 0.1]) + 0.25 * cut)
    off = SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.35)  # one above: no cut
    assert np.allclose(dense(distribution(logits, off), 4), [0.4, 0.3, 0.2, 0.1])


def test_mirostat_v2_keeps_the_tokens_whose_surprise_is_within_mu():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    params = SamplingParams(temperature=1.0, mirostat=2)
    assert np.allclose(dense(distribution(logits, params, mu=2.0), 4), [2 / 3, 1 / 3, 0, 0])  # -log2 0.25 = 2
    assert np.allclose(dense(distribution(logits, params, mu=0.5), 4), [1, 0, 0, 0])  # at least the top one
    with pytest.raises(ValueError, match="mu"):
        distribution(logits, params)


def test_mirostat_v1_truncates_to_its_zipf_estimate_of_k():
    ranks = np.arange(1, 201)
    logits = np.log(ranks ** -1.2)  # a Zipf law with s = 1.2: the estimate finds it exactly
    params = SamplingParams(temperature=1.0, mirostat=1)
    for mu in (3.0, 6.0, 9.0):
        e = 0.2
        k = int((e * 2 ** mu / (1 - 200 ** -e)) ** (1 / 1.2))
        assert distribution(logits, params, mu=mu).ids.tolist() == list(range(max(k, 1)))


# --- Verification: the target's distribution, whatever q ---------------------------------------------------------

def fit(counts: np.ndarray, expected: np.ndarray) -> float:
    """The chi-square p-value of `counts` against probabilities `expected`, cells under 5 expected pooled; 0 where a
    token of probability 0 came out."""
    if counts[expected == 0].any():
        return 0.0
    expected = expected * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    wanted = np.append(expected[~small], expected[small].sum())
    return chisquare(observed[wanted > 0], wanted[wanted > 0]).pvalue


def rows_and_q(seed: int, n_vocab: int = 12, n_rows: int = 3) -> tuple[np.ndarray, list[SparseDist]]:
    """Target rows (the last one the bonus's) and a draft's q for each draft position, deliberately unlike p."""
    rng = np.random.default_rng(seed)
    rows = rng.normal(0, 1.5, (n_rows, n_vocab)).astype(np.float32)
    qs = [distribution(rng.normal(0, 1.0, n_vocab), SamplingParams(temperature=1.4, top_k=8)) for _ in rows[:-1]]
    return rows, qs


def first_two_fits(params: SamplingParams, coupled: bool, verify=verify_stochastic) -> tuple[float, float]:
    """p-values of the first two emitted tokens against p of rows 0 and 1 (the rows depend on no history here, so
    the second token, where one is emitted, follows row 1's p too)."""
    rows, qs = rows_and_q(11)
    n_vocab = rows.shape[1]
    counts = np.zeros((2, n_vocab))
    rng = np.random.default_rng(5)
    for trial in range(TRIALS):
        if coupled:
            drafts = [coupled_sample(q, trial, 10 + i) for i, q in enumerate(qs)]
            tokens = verify_coupled(drafts, rows, params, trial, 10).tokens
        else:
            drafts = [sample(q, rng) for q in qs]
            tokens = verify(drafts, qs, rows, params, rng).tokens
        for i, token in enumerate(tokens[:2]):
            counts[i, token] += 1
    return tuple(fit(counts[i], dense(distribution(rows[i], params), n_vocab)) for i in range(2))


@pytest.mark.parametrize("coupled", [False, True], ids=["residual", "coupled"])
@pytest.mark.parametrize("params", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_verified_tokens_follow_the_targets_distribution_under_each_sampler(params, coupled):
    assert min(first_two_fits(params, coupled)) > SIGNIFICANCE


def test_verifying_xtc_against_its_uncut_row_is_caught():
    """Teeth: a verifier that forgets XTC's coin (verifies with the uncut row) misses the mixture by far."""
    params = SamplingParams(temperature=1.0, xtc_probability=0.9, xtc_threshold=0.08)

    def uncut(drafts, qs, rows, p, rng):
        return verify_stochastic(drafts, qs, rows, replace(p, xtc_probability=0.0), rng)

    assert min(first_two_fits(params, False, uncut)) < SIGNIFICANCE


# --- Mirostat: mu walks along the chain --------------------------------------------------------------------------

MIROSTAT = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=1.5, mirostat_eta=1.0)


def mirostat_rows() -> np.ndarray:
    """Two rows whose second keeps more or fewer tokens as the first token's surprise moves mu."""
    row = np.log(np.array([0.36, 0.2, 0.14, 0.1, 0.08, 0.06, 0.04, 0.02]))
    return np.stack([row, row[::-1].copy(), row])


def walked(rows: np.ndarray, tokens: list[int], mu: float) -> list[float]:
    """mu before each of `tokens` and after the last, walked as llama.cpp's sampler walks it."""
    mus = [mu]
    for row, token in zip(rows, tokens):
        p = dense(distribution(row, MIROSTAT, mus[-1]), row.size)
        mus.append(mus[-1] - MIROSTAT.mirostat_eta * (-math.log2(p[token]) - MIROSTAT.mirostat_tau))
    return mus


def mirostat_fits(coupled: bool, check_walk: bool = True) -> tuple[float, float]:
    """p-values of the first token against p0(mu0), and of the second given the first against p1(mu1(first)); each
    verdict's mu checked against the walk along its tokens."""
    rows, mu0 = mirostat_rows(), MIROSTAT.start_mu()
    q = distribution(np.zeros(8), SamplingParams(temperature=1.0))  # uniform: nothing like p
    n = rows.shape[1]
    first, pairs = np.zeros(n), np.zeros((n, n))
    rng = np.random.default_rng(3)
    for trial in range(2 * TRIALS):
        if coupled:
            verdict = verify_coupled([coupled_sample(q, trial, 0), coupled_sample(q, trial, 1)], rows, MIROSTAT,
                                     trial, 0, mu0)
        else:
            verdict = verify_stochastic([sample(q, rng), sample(q, rng)], [q, q], rows, MIROSTAT, rng, mu0)
        assert not check_walk or math.isclose(verdict.mu, walked(rows, verdict.tokens, mu0)[-1])
        first[verdict.tokens[0]] += 1
        if len(verdict.tokens) > 1:
            pairs[verdict.tokens[0], verdict.tokens[1]] += 1
    expected_pairs = np.concatenate([pairs[t].sum() * dense(distribution(rows[1], MIROSTAT, walked(rows, [t], mu0)[1]),
                                                            n) if pairs[t].any() else np.zeros(n) for t in range(n)])
    return (fit(first, dense(distribution(rows[0], MIROSTAT, mu0), n)),
            fit(pairs.ravel(), expected_pairs / expected_pairs.sum()))


def test_mirostat_rows_depend_on_the_token_before():
    rows, mu0 = mirostat_rows(), MIROSTAT.start_mu()
    firsts = distribution(rows[0], MIROSTAT, mu0).ids
    supports = {distribution(rows[1], MIROSTAT, walked(rows, [t], mu0)[1]).ids.size for t in firsts}
    assert len(supports) == len(firsts) > 1  # what the first token was changes what the second may be


@pytest.mark.parametrize("coupled", [False, True], ids=["residual", "coupled"])
def test_mirostat_walks_mu_along_the_verified_chain(coupled):
    assert min(mirostat_fits(coupled)) > SIGNIFICANCE


def test_a_verifier_that_keeps_mu_still_along_the_chain_is_caught(monkeypatch):
    """Teeth: row 1 verified with mu before the chain (not after its first token) misses the target by far."""
    monkeypatch.setattr(verification, "advance", lambda params, mu, dist, token: mu)
    assert min(mirostat_fits(False, check_walk=False)) < SIGNIFICANCE  # (the walk's own check would tell at once)


def test_the_draft_walks_its_mu_along_its_chain_and_restarts_from_the_targets_at_a_commit():
    rows, mu0 = mirostat_rows(), MIROSTAT.start_mu()
    session = DraftSession(session_id=1, chain=[0, 1], committed=2, params=MIROSTAT, rng=np.random.default_rng(0),
                           max_ahead=8, p_min=0.0, slot=Slot(0, None), n_ctx=64, committed_mu=mu0)
    first, _, _ = draw(session, rows[0].copy(), 2)
    second, _, _ = draw(session, rows[1].copy(), 3)
    assert session.mus[4] == pytest.approx(walked(rows, [first, second], mu0)[-1])
    session.chain += [first, second]
    session.apply_commit(2, [first, second], mu=1.25)  # the target's own mu after them
    assert session.mu_at(4) == 1.25 and session.mus == {}


# --- DRY: a penalty by the repetitions of the tokens before each row -----------------------------------------------

def dry_reference(dry: Dry, context: list[int], n_vocab: int) -> np.ndarray:
    """The penalty of each token, by llama.cpp's definition: for each earlier position i the longest suffix of the
    context ending there too (at most the tokens after the latest restart sequence), found naively."""
    c = context[-dry.penalty_last_n:] if dry.penalty_last_n > 0 else list(context)
    n, penalty, longest = len(c), np.zeros(n_vocab), {}
    limit = n
    for back in range(n):  # the latest restart head whose tail follows it
        at = n - 1 - back
        tails = [t for t in (dry.restarts or {}).get(c[at], ()) if len(t) <= back and tuple(c[at + 1:at + 1 + len(t)]) == t]
        if tails:
            limit = back - max(len(t) for t in tails)
            break
    if n <= dry.allowed_length or limit < dry.allowed_length:
        return penalty
    for i in range(n - 1):
        length = 0
        while length <= i and c[i - length] == c[n - 1 - length]:
            length += 1
        length = min(length, limit)
        if length >= dry.allowed_length:
            longest[c[i + 1]] = max(longest.get(c[i + 1], 0), length)
    for token, length in longest.items():
        if () not in (dry.restarts or {}).get(token, ()):
            penalty[token] = dry.multiplier * dry.base ** (length - dry.allowed_length)
    return penalty


def test_dry_penalizes_what_would_extend_a_repetition_as_llama_cpp_counts_it():
    a, b, c, y = 0, 1, 2, 3
    dry = Dry(multiplier=0.8, base=2.0, allowed_length=2, restarts={})
    row = np.zeros(5, dtype=np.float32)
    dry.apply(row, np.array([a, b, c, c, b, c, y, a, b, c]))
    # "a b c" ends at position 2 too: c would repeat 3 tokens (0.8 * 2^1); "b c" ends at 5: y repeats 2 (0.8 * 2^0)
    assert row.tolist() == pytest.approx([0, 0, -1.6, -0.8, 0])


def test_dry_counts_no_repetition_across_a_sequence_breaker():
    a, b, c, newline = 0, 1, 2, 3
    dry = Dry(multiplier=1.0, base=2.0, allowed_length=2, restarts={newline: ((),)})
    row = np.zeros(5, dtype=np.float32)
    dry.apply(row, np.array([a, b, c, a, b, newline, a, b]))
    assert row.tolist() == [0, 0, -1.0, 0, 0]  # "a b" since the newline: c would repeat 2 (not 3, across it)
    row = np.zeros(5, dtype=np.float32)
    dry.apply(row, np.array([a, b, newline, a, b, newline, a, b]))
    assert row[newline] == 0  # a single-token breaker is never penalized


def test_dry_matches_its_reference_on_random_contexts_with_breakers_of_several_tokens():
    rng = np.random.default_rng(2)
    for _ in range(200):
        restarts = {3: ((),), 4: ((5,), (5, 6))}
        dry = Dry(multiplier=0.5, base=1.75, allowed_length=int(rng.integers(0, 4)),
                  penalty_last_n=int(rng.choice([-1, 12, 30])), restarts=restarts)
        context = rng.integers(0, 8, int(rng.integers(0, 60))).tolist()
        row = np.zeros(8)
        dry.apply(row, np.array(context, dtype=np.int64))
        assert np.allclose(-row, dry_reference(dry, context, 8)), context


def test_each_verified_row_is_penalized_after_the_drafts_before_it():
    rng = np.random.default_rng(4)
    penalties = Penalties(dry=Dry(multiplier=1.0, base=1.5, allowed_length=1, restarts={}))
    committed = rng.integers(0, 6, 40).tolist()
    drafts = [int(t) for t in rng.integers(0, 6, 5)]
    rows = rng.normal(0, 1, (len(drafts) + 1, 6))
    transformed = rows.copy()
    transform(penalties, transformed, committed, drafts, None)
    for i in range(len(rows)):
        assert np.allclose(rows[i] - transformed[i], dry_reference(penalties.dry, committed + drafts[:i], 6))
    assert not np.allclose(transformed[0], transformed[-1] - (rows[-1] - rows[0]))  # the drafts changed something


class FakeVocab:
    """Token texts and a tokenizer that spells each byte as its own token (ids past the pieces)."""

    n_vocab = 6
    pieces = [b"a", b"b:", b"\n", b"x\"", b"ab", b"c"]

    def token_piece(self, token: int, *, special: bool = False) -> bytes:
        return self.pieces[token]

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [100 + byte for byte in text.encode()]


def test_sequence_breakers_become_llama_cpps_restart_sequences():
    restarts = restart_sequences(FakeVocab(), ["\n", ":", "ab\""])
    assert restarts[2] == ((),) and restarts[1] == ((),)  # the text holds a breaker: it breaks alone
    # "ab\"": "a" and "ab" start it (the rest tokenized follows); "x\"" holds no start of it but its last byte
    assert restarts[0] == ((100 + ord("b"), 100 + ord("\"")),) and restarts[4] == ((100 + ord("\""),),)
    assert 3 not in restarts and 5 not in restarts


def test_the_restart_sequences_kept_per_model_are_bounded_and_the_least_recently_used_go_first():
    vocab = FakeVocab()
    first = restart_sequences(vocab, ["\n"])
    for i in range(dry.MAX_KNOWN_BREAKER_LISTS + 5):  # clients choose the lists: as many as they like
        restart_sequences(vocab, [f"x{i}"])
        restart_sequences(vocab, ["\n"])  # used again and again: kept
    known = dry._restarts[vocab]
    assert len(known) == dry.MAX_KNOWN_BREAKER_LISTS and ("\n",) in known and ("x0",) not in known
    assert restart_sequences(vocab, ["\n"]) is first
    assert restart_sequences(vocab, ["x0"]) == restart_sequences(FakeVocab(), ["x0"])  # walked again, the same
