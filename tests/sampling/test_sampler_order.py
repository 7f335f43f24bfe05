"""The sampler chain in llama.cpp's order: the truncations read the temperature-1 probabilities and the temperature comes
last (common.h's default), or the turn `samplers` gives; the same on both sides, so exact under speculation."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest

from duo.api.openai.bodies import CompletionBody
from duo.api.serving.request import BadRequest
from duo.net import wire
from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.sampling.distributions import distribution
from duo.sampling.params import SamplingParams
from helpers.duo_runs import SAMPLED_PROMPT
from helpers.exact_fit import first_two_p_values
from helpers.http import post
from helpers.stats import dense

T, TOP_P, MIN_P = 0.7, 0.9, 0.05  # the preset: where the two orders part
LLAMA_DEFAULT = "kypmt"  # common.h's chain with top-n-sigma and xtc off (penalties and DRY come before it)


# --- Reference: llama.cpp's chain applied by hand, sampler by sampler as llama-sampler.cpp's loops read ------------

def softmax(values: list[float]) -> np.ndarray:
    x = np.array(values, dtype=np.float64)
    w = np.exp(x - x.max())
    return w / w.sum()


def llama_chain(logits: np.ndarray, order: str, *, top_k: int = 0, typical_p: float = 1.0) -> np.ndarray:
    """The dense distribution llama.cpp's dist sampler draws from after the chain `order` (sampling_seq letters) at
    temperature T, top-p TOP_P, min-p MIN_P: each sampler on the candidates (logit, id) the ones before it left."""
    cand = [(float(logit), i) for i, logit in enumerate(logits) if logit > -np.inf]
    for code in order:
        cand.sort(key=lambda c: (-c[0], c[1]))  # llama.cpp sorts by logit where a sampler needs it
        probs = softmax([logit for logit, _ in cand])
        if code == "t":
            cand = [(logit / T, i) for logit, i in cand]
        elif code == "k" and top_k > 0:
            cand = cand[:top_k]
        elif code == "p":
            total = 0.0
            for n, q in enumerate(probs):
                total += q
                if total >= TOP_P:
                    cand = cand[:n + 1]
                    break
        elif code == "m":
            floor = cand[0][0] + math.log(MIN_P)  # p >= MIN_P * p_max, on the logits as they stand
            cand = [c for c in cand if c[0] >= floor]
        elif code == "y" and typical_p < 1:
            entropy = -float(np.sum(probs * np.log(probs)))
            ranked = sorted(range(len(cand)), key=lambda j: abs(-math.log(probs[j]) - entropy))
            total, kept = 0.0, []
            for j in ranked:
                total += probs[j]
                kept.append(j)
                if total > typical_p:
                    break
            cand = [cand[j] for j in sorted(kept)]
    out = np.zeros(logits.size)
    out[[i for _, i in cand]] = softmax([logit for logit, _ in cand])
    return out


def random_rows(n: int = 10, vocab: int = 60) -> list[np.ndarray]:
    rng = np.random.default_rng(53)
    rows = [rng.normal(0, 2.0, vocab).astype(np.float32) for _ in range(n)]
    for row in rows:
        row[rng.integers(0, vocab)] = -np.inf  # a banned token stays out whatever the order
    return rows


# --- The distribution -----------------------------------------------------------------------------------------------

def test_by_default_the_truncations_read_temperature_one_and_the_temperature_comes_last():
    params = SamplingParams(temperature=T, top_p=TOP_P, min_p=MIN_P)
    for row in random_rows():
        assert np.allclose(dense(distribution(row, params), row.size), llama_chain(row, LLAMA_DEFAULT), atol=1e-9)


def test_the_default_order_differs_from_the_temperature_first_on_these_rows():
    """Teeth for the test above: on these rows the two orders give different distributions."""
    assert any(not np.allclose(llama_chain(row, LLAMA_DEFAULT), llama_chain(row, "tpm"), atol=1e-3)
               for row in random_rows())


@pytest.mark.parametrize("order", ["tkypm", "ptm", "mpt", "tpmt", "ymtp", "pkm"])
def test_a_custom_order_runs_each_sampler_where_samplers_puts_it(order):
    params = SamplingParams(temperature=T, top_p=TOP_P, min_p=MIN_P, top_k=12, typical_p=0.8, order=order)
    for row in random_rows():
        expected = llama_chain(row, order, top_k=12, typical_p=0.8)
        assert np.allclose(dense(distribution(row, params), row.size), expected, atol=1e-9), order


def test_a_sampler_left_out_of_the_order_does_not_apply():
    params = SamplingParams(temperature=T, top_p=TOP_P, min_p=MIN_P, order="p")
    for row in random_rows():
        assert np.allclose(dense(distribution(row, params), row.size), llama_chain(row, "p"), atol=1e-9)


def test_the_draft_applies_the_same_chain_as_it_arrives_over_the_wire():
    """The draft samples q from the params the target sends it (duo.draft.session.draw: distribution of its row):
    the order travels, so its q is the target's p wherever the two models agree."""
    for order in ("skypmxt", "tpm", "ptm", ""):
        params = SamplingParams(temperature=T, top_p=TOP_P, min_p=MIN_P, order=order)
        received, _ = wire.sampling_from_pb(wire.sampling_to_pb(params, None), None)
        assert received.order == order
        for row in random_rows(3):
            assert np.allclose(dense(distribution(row, received), row.size),
                               dense(distribution(row, params), row.size))


# --- The request field ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("samplers, order", [
    (None, "skypmxt"),  # llama-server's default chain (penalties and DRY before it: duo.sampling.rows)
    (["top_p", "temperature", "min_p"], "ptm"),
    (["Top-P", "temp", "minp"], "ptm"),  # any case, kebab-case and no-dash spellings, as llama.cpp reads them
    ("tpm", "tpm"),  # the sampling_seq letters
    (["typical_p", "top_p", "temperature"], "pt"),  # llama.cpp has no "typical_p" sampler name: skipped as it does
])
def test_samplers_sets_the_order_of_the_chain(samplers, order):
    body = CompletionBody(prompt="x", temperature=T, top_p=TOP_P, min_p=MIN_P, samplers=samplers)
    assert body.to_request().params.order == order


@pytest.mark.parametrize("samplers, field", [
    (["temperature", "penalties"], {"presence_penalty": 0.5}),
    (["top_p", "dry"], {"dry_multiplier": 0.8}),
])
def test_penalties_listed_after_a_sampler_that_acts_are_refused_naming_samplers(samplers, field):
    body = CompletionBody(prompt="x", temperature=T, top_p=TOP_P, samplers=samplers, **field)
    with pytest.raises(BadRequest, match="samplers") as refused:
        body.to_request()
    assert refused.value.param == "samplers"


def test_penalties_listed_first_or_off_are_taken():
    assert CompletionBody(prompt="x", temperature=T, samplers=["penalties", "temperature"],
                          presence_penalty=0.5).to_request().penalties.presence == 0.5
    assert CompletionBody(prompt="x", temperature=T, samplers=["temperature", "penalties"]).to_request()


# --- Served: samples through a target with a draft attached ---------------------------------------------------------

def served_samples(address: str, n: int) -> tuple[list[list[int]], list[pb.Stats]]:
    """n two-token generations of SAMPLED_PROMPT at the preset, unseeded (residual rejection), one at a time."""
    sampling = pb.SamplingParams(temperature=T, top_p=TOP_P, min_p=MIN_P)
    samples, stats = [], []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TargetStub(channel)
        for _ in range(n):
            request = pb.GenerateRequest(prompt=SAMPLED_PROMPT, max_tokens=2, sampling=sampling)
            tokens, last = [], pb.GenerateResponse()
            for response in stub.Generate(request, timeout=60):
                tokens.extend(response.token_ids)
                last = response
            samples.append(tokens)
            stats.append(last.stats)
    return samples, stats


def test_served_samples_with_a_draft_follow_llama_cpps_chain(served_sync, target_model):
    """Chi-square of the first two tokens of 400 served generations (a draft verified at every step: --sync 4)
    against the target's distribution under llama.cpp's chain (helpers.exact_fit), with drafts accepted."""
    samples, stats = served_samples(served_sync.address, 400)
    assert sum(s.draft_tokens_accepted for s in stats) > 0, "the draft took no part"
    chain = SamplingParams(temperature=T, top_p=TOP_P, min_p=MIN_P)
    p_values = first_two_p_values(target_model, target_model.tokenize(SAMPLED_PROMPT), samples, chain)
    assert all(p > 1e-4 for p in p_values), p_values  # NaN (a token outside the chain's support came out) fails


def test_served_samples_follow_the_order_samplers_gives_over_http(served_sync, target_model):
    """llama-server's /completion with `samplers: "ptm"` (the temperature between top-p and min-p) through the
    target with its draft: the first two tokens of 300 answers fit that chain's distribution, drafts accepted. At
    T 0.7 the tiny target's first token under this chain is certain (no test); at 1.8 three tokens remain, where
    the temperature first would leave nine."""
    hot = 1.8
    body = {"prompt": SAMPLED_PROMPT, "n_predict": 2, "temperature": hot, "top_p": TOP_P, "min_p": MIN_P,
            "samplers": "ptm"}
    answers = [post(served_sync, "/completion", body).json() for _ in range(300)]
    assert sum(answer["timings"]["draft_n_accepted"] for answer in answers) > 0, "the draft took no part"
    chain = SamplingParams(temperature=hot, top_p=TOP_P, min_p=MIN_P, order="ptm")
    samples = [answer["tokens"] for answer in answers]
    p_values = first_two_p_values(target_model, target_model.tokenize(SAMPLED_PROMPT), samples, chain)
    assert all(p > 1e-4 for p in p_values), p_values
