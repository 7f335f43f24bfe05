"""Coupled sampling: the noise function, its exactness, and the same seed giving the same text with a draft."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
from scipy.stats import chisquare

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.draft.drafter import Drafter, InvalidEvent
from duo.llama.worker import ModelWorker
from duo.sampling import coupled, verification
from duo.sampling.coupled import coupled_sample
from duo.sampling.distributions import distribution
from duo.sampling.noise import noise_key, uniforms
from duo.sampling.params import SamplingParams
from duo.sampling.verification import verify_coupled
from helpers.greedy import leaves_coupled_path_only_at_a_near_tie
from helpers.processes import generate, start, wait_for_draft
from helpers.drafting import draft_once
from helpers.exact_fit import first_two_p_values
from helpers.duo_runs import PROMPTS, SAMPLED_PROMPT, sample_positions, stream_and_interrupt
from helpers.http import client, model_name

MASK = 2**64 - 1


def reference_u(seed: int, position: int, token: int) -> float:
    """proto/duo.proto's COUPLED noise, written out from its text in plain Python integers."""
    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def splitmix(state: int, n: int) -> int:
        return mix((state + n * 0x9E3779B97F4A7C15) & MASK)

    key = splitmix(mix(seed), position + 1)
    return ((splitmix(key, token + 1) >> 11) + 0.5) / 2**53


def test_the_noise_function_is_pinned():
    # SplitMix64's first output from state 0 is 0xE220A8397B1DCDAF (mix(0) = 0, so this is the key at 0, 0).
    assert noise_key(0, 0) == 0xE220A8397B1DCDAF
    assert noise_key(42, 7) == 2820384354626331986
    assert noise_key(MASK, 100000) == 14649325440931314773
    assert uniforms(42, 7, np.array([0, 1, 2, 151935])).tolist() == [
        0.8130366761818051, 0.9134455418061547, 0.05753058695658314, 0.9476293396680735]
    assert uniforms(2**63 + 5, 0, np.array([0, 99])).tolist() == [0.4523485204771483, 0.8234852702700983]


def test_the_noise_follows_the_protocols_text_bit_for_bit():
    rng = np.random.default_rng(0)
    for _ in range(20):
        seed, position = int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2)), int(rng.integers(0, 1 << 20))
        ids = rng.integers(0, 151936, size=16)
        assert uniforms(seed, position, ids).tolist() == [reference_u(seed, position, int(i)) for i in ids]


LOGITS = np.random.default_rng(3).normal(0, 1.5, size=40).astype(np.float32)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=6),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.3, min_p=0.1),
])
def test_coupled_samples_follow_the_distribution_over_seeds_and_over_positions(params):
    dist = distribution(LOGITS, params)
    expected = dict(zip(dist.ids.tolist(), dist.probs))
    for draws in ([coupled_sample(dist, seed, 5) for seed in range(4000)],
                  [coupled_sample(dist, 11, position) for position in range(4000)]):
        assert set(draws) <= set(expected), "a token outside the truncated support"
        counts = np.array([draws.count(t) for t in expected])
        assert chisquare(counts, np.array(list(expected.values())) * len(draws)).pvalue > 1e-3


def test_the_coupled_sample_is_a_function_of_seed_position_and_logits():
    dist = distribution(LOGITS, SamplingParams(temperature=1.0))
    assert [coupled_sample(dist, 9, p) for p in range(50)] == [coupled_sample(dist, 9, p) for p in range(50)]
    assert [coupled_sample(dist, 9, p) for p in range(50)] != [coupled_sample(dist, 10, p) for p in range(50)]


@pytest.mark.parametrize("cut", [coupled.RACE_CUT, 2.0, 0.01])  # small cuts: many rivals past the cut race
def test_the_bounded_race_equals_the_whole_vocabulary_race_for_every_seed(monkeypatch, cut):
    monkeypatch.setattr(coupled, "RACE_CUT", cut)
    monkeypatch.setattr(coupled, "TAIL_WEIGHT", np.exp(-cut) * (1 + 1e-9))
    rng = np.random.default_rng(int(cut * 100))
    for trial in range(120):
        n_vocab = 151936 if trial % 10 == 0 else 4096
        logits = rng.standard_normal(n_vocab) * rng.choice([0.3, 1.0, 3.0])
        logits[rng.integers(n_vocab, size=3)] += rng.uniform(0, 20, size=3)  # peaked rows, as LLMs give
        logits[rng.integers(n_vocab, size=5)] = -np.inf
        logits = logits.astype(rng.choice([np.float32, np.float64]))
        params = SamplingParams(temperature=float(rng.choice([0.05, 0.3, 0.7, 1.0, 2.0])))
        seed, position, n = int(rng.integers(2**64, dtype=np.uint64)), int(rng.integers(10**6)), trial % 3 + 1
        full_ids, full_keys = coupled.coupled_ranking(distribution(logits, params), seed, position, n)
        ids, keys = coupled.coupled_race(logits, params, seed, position, n)
        assert ids.tolist() == full_ids.tolist()
        assert np.diff(keys) == pytest.approx(np.diff(full_keys))  # keys up to ln of the normaliser


def test_coupled_verification_outputs_the_targets_own_samples_whatever_the_drafts():
    rng = np.random.default_rng(1)
    params, seed, start = SamplingParams(temperature=1.0, top_k=8), 77, 30
    rows = rng.normal(0, 1, size=(5, 40)).astype(np.float32)
    own = [coupled_sample(distribution(row, params), seed, start + i) for i, row in enumerate(rows)]
    verdict = verify_coupled(own[:4], rows, params, seed, start)  # the target's own picks: all kept, and a bonus
    assert (verdict.n_accepted, verdict.tokens) == (4, own)
    for _ in range(30):
        drafts = [t if rng.random() < 0.6 else int(rng.integers(0, 40)) for t in own[:4]]
        verdict = verify_coupled(drafts, rows, params, seed, start)
        agreed = next((i for i, (d, t) in enumerate(zip(drafts, own)) if d != t), 4)
        assert verdict.n_accepted == agreed and verdict.tokens == own[:agreed + 1]


def test_verify_takes_the_coupled_path_only_with_a_seed():
    rows = np.random.default_rng(2).normal(0, 1, size=(2, 40)).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    coupled = verification.verify([5], None, rows, params, np.random.default_rng(), coupled_seed=3, start=9)
    assert coupled.tokens == verify_coupled([5], rows, params, 3, 9).tokens
    with pytest.raises(ValueError, match="draft distributions"):
        verification.verify([5], None, rows, params, np.random.default_rng())  # residual needs q


def open_message(verification: int, seed: int | None = 5, **sampling_fields) -> pb.OpenSession:
    sampling_pb = pb.SamplingParams(temperature=1.0, **sampling_fields)
    if seed is not None:
        sampling_pb.seed = seed
    return pb.OpenSession(session_id=1, committed=[1, 2, 3], max_ahead=4, sampling=sampling_pb,
                          verification=verification)


def test_a_coupled_draft_proposes_the_coupled_sample_of_its_whole_distribution_and_sends_no_q(draft_model):
    async def first_chunk() -> tuple[pb.DraftChunk, SamplingParams]:
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=64, top_k_cap=10)
        session = await drafter.open(open_message(pb.COUPLED))
        chunk = await draft_once(drafter, session)
        await drafter.close(session)
        await drafter.stop()
        return chunk, session.params

    chunk, params = asyncio.run(first_chunk())
    assert params.top_k == 0, "coupled sessions send no q, so nothing caps their distribution"
    context = draft_model.new_context(64)
    logits = context.decode([1, 2, 3], 0)[-1]
    context.close()
    assert list(chunk.tokens) == [coupled_sample(distribution(logits, SamplingParams(temperature=1.0)), 5, 3)]
    assert not chunk.dists


@pytest.mark.parametrize("message, words", [
    (open_message(pb.COUPLED, seed=None), "needs sampling.seed"),
    (open_message(7), "unknown verification 7"),
])
def test_a_draft_refuses_a_coupled_session_it_cannot_follow(draft_model, message, words):
    async def open_it() -> None:
        await Drafter(draft_model, ModelWorker(), n_ctx=64, top_k_cap=10).open(message)

    with pytest.raises(InvalidEvent, match=words):
        asyncio.run(open_it())


# --- through the processes ----------------------------------------------------------------------------

TRUNCATIONS = [{}, {"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.1}]


@pytest.mark.parametrize("truncation", TRUNCATIONS)
def test_the_same_seed_gives_the_same_tokens_with_and_without_a_draft(served_alone, served_duo, served_sync,
                                                                      truncation, target_model):
    verified = 0
    for seed in (0, 1, 2):
        expected, alone = generate(served_alone.address, PROMPTS[1], max_tokens=40, temperature=1.0, seed=seed,
                                   **truncation)
        assert alone.stats.verification == "coupled" and alone.stats.seed == seed
        for duo in (served_duo, served_sync):
            tokens, last = generate(duo.address, PROMPTS[1], max_tokens=40, temperature=1.0, seed=seed, **truncation)
            params = SamplingParams(temperature=1.0, **truncation)
            assert tokens == expected or leaves_coupled_path_only_at_a_near_tie(  # cached prompt cells round apart
                target_model, PROMPTS[1], tokens, 40, params, seed), (duo.address, seed)
            verified += last.stats.draft_tokens_verified
    assert verified > 0  # the synchronous target verified drafts at every step


def test_the_same_seed_gives_the_same_tokens_with_the_draft_killed_mid_generation(tiny_target, tiny_draft,
                                                                                    target_model, process_logs):
    draft = start("duo.cli.draft", ["--model", str(tiny_draft)], process_logs)
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, "--sync", "4"],
                   process_logs)
    try:
        wait_for_draft(target.address)
        tokens, received_at_kill = stream_and_interrupt(target.address, PROMPTS[0], 200, draft.kill,
                                                        temperature=0.9, seed=42)
        assert received_at_kill > 0 and leaves_coupled_path_only_at_a_near_tie(
            target_model, PROMPTS[0], tokens, 200, SamplingParams(temperature=0.9), 42)
    finally:
        target.stop()
        draft.stop()


def test_four_concurrent_requests_each_get_their_seeds_tokens(served_alone, served_duo, target_model):
    seeds = [7, 7, 8, 9]
    expected = {seed: generate(served_alone.address, PROMPTS[2], max_tokens=40, temperature=0.8, seed=seed)[0]
                for seed in set(seeds)}
    results: list[list[int]] = [[] for _ in seeds]

    def work(i: int) -> None:
        results[i] = generate(served_duo.address, PROMPTS[2], max_tokens=40, temperature=0.8, seed=seeds[i])[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(seeds))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Each follows its own seed's samples; batched with the others (and starting from their cached
    # prompt) its logits round a little differently, so it may part from them only at a near-tie.
    params = SamplingParams(temperature=0.8)
    for seed, tokens in [*zip(seeds, results), *expected.items()]:
        assert tokens and leaves_coupled_path_only_at_a_near_tie(target_model, PROMPTS[2], tokens, 40, params, seed), seed


@pytest.mark.parametrize("truncation", [{}, {"top_k": 5, "top_p": 0.9, "min_p": 0.05}])
def test_coupled_samples_through_duo_follow_the_target_distribution(served_sync, target_model, truncation):
    """Seeded requests through a target that verifies drafts at every step: their first two tokens fit the
    target's exact distribution (tests/helpers/exact_fit.py), and the same requests accepted drafts."""
    n = 400
    through_duo, stats = sample_positions(served_sync.address, n, 2, seeded=True, **truncation)
    # the pairs vary (7 occur under the truncation, dozens without it): the fit is not trivially passed
    assert len({tuple(t) for t in through_duo}) > 5
    assert {s.verification for s in stats} == {"coupled"}
    assert sum(s.draft_tokens_accepted for s in stats) >= 0.3 * 2 * n
    p_values = first_two_p_values(target_model, target_model.tokenize(SAMPLED_PROMPT), through_duo,
                                  SamplingParams(temperature=1.0, **truncation))
    assert min(p_values) > 1e-4, p_values


def test_the_openai_clients_seed_check_passes_with_a_draft_attached(served_alone, served_duo, target_model):
    """Same seed, same text (up to near-ties, see below): through the draft or not, streamed or not,
    completion or chat."""
    def text(process, stream: bool = False, chat: bool = False) -> str:
        api, name = client(process), model_name(process)
        common = {"model": name, "max_tokens": 32, "temperature": 0.9, "seed": 42, "stream": stream}
        if chat:
            response = api.chat.completions.create(messages=[{"role": "user", "content": "hello"}], **common)
            return "".join(c.choices[0].delta.content or "" for c in response if c.choices) if stream \
                else response.choices[0].message.content
        response = api.completions.create(prompt=PROMPTS[1], **common)
        return "".join(c.choices[0].text for c in response) if stream else response.choices[0].text

    # Each is the target's own coupled sample for seed 42, as decoded afresh here. It may part from it
    # only at a near-tie, because a prompt's cells cached by an earlier request (and batching) round
    # the logits a little differently.
    chat = pb.TokenizeRequest(messages=[pb.ChatMessage(role="user", content="hello")])
    with grpc.insecure_channel(served_alone.address) as channel:
        chat_prompt = list(pb_grpc.TargetStub(channel).Tokenize(chat).token_ids)
    # The fields the requests leave out take llama-server's defaults (top_k 40, top_p 0.95, min_p 0.05).
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05)
    for prompt, is_chat in ((PROMPTS[1], False), (chat_prompt, True)):
        texts = [text(served_duo, chat=is_chat), text(served_duo, chat=is_chat),
                 text(served_duo, stream=True, chat=is_chat), text(served_alone, chat=is_chat)]
        for got in texts:
            assert got and leaves_coupled_path_only_at_a_near_tie(target_model, prompt, got, 32, params, 42), got


def test_unseeded_requests_use_the_configured_mode_and_report_a_seed_that_replays_them(tiny_target, served_draft,
                                                                                      process_logs, target_model):
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", served_draft.address,
                                          "--unseeded", "coupled"], process_logs)
    try:
        wait_for_draft(target.address)
        tokens, last = generate(target.address, PROMPTS[1], max_tokens=32, temperature=1.0)
        assert last.stats.verification == "coupled"
        replay = generate(target.address, PROMPTS[1], max_tokens=32, temperature=1.0, seed=last.stats.seed)[0]
        params = SamplingParams(temperature=1.0)
        for answer in (tokens, replay):  # both the seed's own samples (the replay reads cached prompt cells)
            assert leaves_coupled_path_only_at_a_near_tie(target_model, PROMPTS[1], answer, 32, params, last.stats.seed)
        assert generate(target.address, PROMPTS[1], max_tokens=8)[1].stats.verification == "greedy"
    finally:
        target.stop()
