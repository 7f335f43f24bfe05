"""The draft is optional and untrusted, and so is its target: --draft-p-min keeps sampling exact, a bad session
costs that session only, no session's sequences outlive it, sessions are capped, and the draft reports
its work as Prometheus metrics."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Awaitable, Callable

import numpy as np
import pytest

from duo.cli.draft import main
from duo.draft import service
from duo.draft.drafter import Drafted, Drafter
from duo.draft.metrics import DraftMetrics
from duo.draft.service import DraftServicer, SessionLimits
from duo.draft.session import DraftSession, proposes
from duo.llama.model import ModelError
from duo.llama.context import Context
from duo.llama.worker import ModelWorker
from duo.net._proto import duo_pb2 as pb
from duo.sampling.distributions import SparseDist, sample
from duo.sampling.params import SamplingParams
from duo.sampling.verification import verify
from duo.target.target import SYNC_WAIT_S
from helpers.draft_servicer import CountingModel, PROMPT, Peer, Stream, holds_nothing, scrape, servicer_for, slots_held
from helpers.drafting import draft_once
from helpers.duo_runs import SAMPLED_PROMPT, sample_positions
from helpers.exact_fit import first_two_p_values
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.processes import free_port, generate, start, wait_for_draft

PROMPTS = ["def fibonacci(n):", "Once upon a time", "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"]
SAMPLED = pb.SamplingParams(temperature=1.0)

# --- A. --draft-p-min decides from the draft's top-1 probability, never from the token drawn ---------------


def emitted(p: list[float], q: list[float], sends: Callable[[int], bool], n: int = 20_000) -> np.ndarray:
    """Frequencies of the token the target emits at one position: the draft draws x ~ q and proposes it
    when sends(x); the target verifies it (duo.sampling.verification.verify), or decodes alone without a proposal."""
    rng = np.random.default_rng(0)
    target_row, params = np.log([p]), SamplingParams(temperature=1.0)
    q_dist = SparseDist(np.arange(len(q)), np.array(q))
    counts = np.zeros(len(p))
    for _ in range(n):
        x = sample(q_dist, rng)
        drafts, dists = ([x], [q_dist]) if sends(x) else ([], [])
        counts[verify(drafts, dists, target_row, params, rng).tokens[0]] += 1
    return counts / n


@pytest.mark.parametrize("p, q, p_min, old_bias", [
    ([0.5, 0.5], [0.9, 0.1], 0.2, 0.05),   # confident draft: the old rule drops token 1 only, P(0) = 0.55
    ([0.3, 0.7], [0.55, 0.45], 0.6, 0.0),  # unsure draft: both rules leave the position to the target
], ids=["confident draft", "unsure draft"])
def test_the_old_p_min_rule_biases_sampled_output_and_the_top1_rule_does_not(p, q, p_min, old_bias):
    old = emitted(p, q, lambda x: q[x] >= p_min)
    new = emitted(p, q, lambda x: proposes(np.log(q), p_min))
    assert np.abs(new - p).max() < 0.015  # 4 standard errors at n = 20000
    assert old[0] - p[0] == pytest.approx(old_bias, abs=0.015)


def test_the_pause_rule_compares_the_top1_probability_at_temperature_1_with_p_min():
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32)) * 3 + 7  # any shift; the scale is the temperature
    top1 = 1 / np.exp(np.log([0.5, 0.3, 0.2]) * 3 - np.log(0.5) * 3).sum()
    assert proposes(logits, top1 - 1e-6) and not proposes(logits, top1 + 1e-6)
    assert proposes(np.log([0.9, 0.1]), 0.2)  # token 1 (0.1 < 0.2) may be drawn: the position is still proposed
    assert proposes(np.array([0.0, 0.0, 0.0, 0.0]), 0.0)  # no p_min: every position is proposed


def test_whether_the_draft_pauses_does_not_depend_on_the_token_it_draws(draft_model):
    """Just below its top-1 probability the draft proposes with every seed (old rule: only the seeds that
    draw the top token); just above, it pauses with every seed."""
    context = draft_model.new_context(64)
    logits = context.decode(PROMPT, 0)[-1].astype(np.float64)
    context.close()
    top1 = 1 / np.exp(logits - logits.max()).sum()

    async def proposals(p_min: float) -> list[int | None]:
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=64, top_k_cap=10)
        tokens = []
        for seed in range(12):
            session = await drafter.open(pb.OpenSession(session_id=seed, committed=PROMPT, max_ahead=4, p_min=p_min,
                                                        sampling=pb.SamplingParams(temperature=1.0, seed=seed)))
            chunk = await draft_once(drafter, session)
            tokens.append(None if chunk is None or chunk.paused else chunk.tokens[0])
            await drafter.close(session)
        await drafter.stop()
        return tokens

    below = asyncio.run(proposals(top1 - 1e-4))
    assert None not in below and len(set(below)) > 1, below  # some seeds drew a token less likely than p_min
    assert asyncio.run(proposals(top1 + 1e-4)) == [None] * 12


def test_sampled_tokens_with_draft_p_min_follow_the_target_distribution(tiny_target, tiny_draft, target_model,
                                                                          process_logs):
    """Through two processes at p_min 0.45, where the tiny draft pauses at about half of its positions
    (its top-1 probability is 0.24-0.74 past the first token). How many proposals the target verifies
    depends on timing (on a busy machine the draft lags and few are), so the test below, which verifies
    every proposal, is the one that tells the old rule from the new."""
    metrics_port = free_port()
    draft = start("duo.cli.draft", ["--model", str(tiny_draft), "--metrics", str(metrics_port)], process_logs)
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, "--draft-max", "4",
                                          "--draft-p-min", "0.45"], process_logs)
    try:
        wait_for_draft(target.address)
        through_duo, _ = sample_positions(target.address, 400, 2)
        p_values = first_two_p_values(target_model, target_model.tokenize(SAMPLED_PROMPT), through_duo,
                                      SamplingParams(temperature=1.0))
        print("p-values by position:", [f"{p:.3g}" for p in p_values])
        assert min(p_values) > 1e-4, p_values
        # A target that waits for the draft at each step verifies its proposals whatever the timing; where
        # the draft paused it says so, and the target decodes alone at once (a wait would last SYNC_WAIT_S).
        sync = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, "--sync", "4",
                                            "--draft-p-min", "0.45"], process_logs)
        try:
            wait_for_draft(sync.address)
            began = time.monotonic()
            _, last = generate(sync.address, "Once upon a time", max_tokens=48, temperature=1.0)
            seconds = time.monotonic() - began
        finally:
            sync.stop()
        assert last.stats.draft_tokens_verified > 0
        alone_steps = last.stats.batch_sizes[1] if len(last.stats.batch_sizes) > 1 else 0
        assert alone_steps >= 3, "the draft hardly paused: the test would not see the pause signal"
        # Without the signal, every step after a pause would first wait SYNC_WAIT_S in vain.
        assert seconds < 0.9 * alone_steps * SYNC_WAIT_S, (seconds, alone_steps)
        metrics = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        assert metrics["duo_draft:p_min_pauses_total"] > 0 and metrics["duo_draft:chunks_sent_total"] > 0
    finally:
        target.stop()
        draft.stop()


async def target_tokens(target: Context, prompt: list[int], n_tokens: int, rng: np.random.Generator,
                        propose: Callable[[list[int]], Awaitable[list[tuple[int, SparseDist]]]],
                        tally: Counter | None = None) -> list[int]:
    """duo's verify loop in one thread: each step the draft proposes what `propose` gives for the committed
    tokens, and the target verifies it in one batch; without proposals it samples alone. `target` holds the
    prompt but its last token. `tally` counts the draft tokens "proposed" and "accepted"."""
    committed = list(prompt)
    target.rollback(len(prompt) - 1)
    while len(committed) - len(prompt) < n_tokens:
        drafts, dists = zip(*proposals) if (proposals := await propose(committed)) else ((), ())
        rows = target.decode([committed[-1], *drafts], len(committed) - 1, logits_for=range(len(drafts) + 1))
        verdict = verify(list(drafts), list(dists), rows, SamplingParams(temperature=1.0), rng)
        committed += verdict.tokens
        if tally is not None:
            tally.update(proposed=len(drafts), accepted=verdict.n_accepted)
        target.rollback(len(committed) - 1)
    return committed[len(prompt):len(prompt) + n_tokens]


def drafter_proposals(drafter: Drafter, session: DraftSession) -> Callable[[list[int]], Awaitable[list]]:
    """What the draft session proposes after each commit: chunks until it pauses or reaches its max_ahead."""
    async def propose(committed: list[int]) -> list[tuple[int, SparseDist]]:
        if len(committed) > session.committed:
            drafter.commit(session, session.committed, committed[session.committed:])
        proposals = []
        while session.wants_to_draft() and (chunk := await draft_once(drafter, session)) is not None and not chunk.paused:
            q = chunk.dists[0]
            proposals.append((chunk.tokens[0], SparseDist(np.array(q.ids), np.array(q.probs) / sum(q.probs))))
        return proposals
    return propose


async def nothing_proposed(committed: list[int]) -> list[tuple[int, SparseDist]]:
    return []


def test_with_every_proposal_verified_sampling_with_p_min_follows_the_target(draft_model, target_model):
    """The tiny models in one thread, so that every proposal is verified (through two processes the draft
    often lags behind the target, which then decodes alone). After "Once upon a time" the draft's top-1
    probability is 0.60 at the first position, so at p_min 0.45 it proposes there (the old rule sent only
    its top token: P(it) 0.92, not the target's 0.79) and pauses at about half of the later positions."""
    prompt, n = draft_model.tokenize("Once upon a time"), 400
    target = target_model.new_context(64)
    tally: Counter = Counter()

    async def samples() -> list[list[int]]:
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=64, top_k_cap=10)
        with_draft = []
        for seed in range(n):
            session = await drafter.open(pb.OpenSession(session_id=seed, committed=prompt, max_ahead=4, p_min=0.45,
                                                        sampling=pb.SamplingParams(temperature=1.0, seed=seed)))
            rng = np.random.default_rng(seed)
            with_draft.append(await target_tokens(target, prompt, 2, rng, drafter_proposals(drafter, session), tally))
            await drafter.close(session)
        await drafter.stop()
        return with_draft

    try:
        target.decode(prompt[:-1], 0, logits_for=[])
        with_draft = asyncio.run(samples())
    finally:
        target.close()
    # The draft proposed at the first position (top-1 0.60 > p_min) and at some later ones; most were taken.
    assert tally["proposed"] >= n and tally["accepted"] >= 0.5 * tally["proposed"], tally
    p_values = first_two_p_values(target_model, prompt, with_draft, SamplingParams(temperature=1.0))
    print("p-values by position:", [f"{p:.3g}" for p in p_values])
    assert min(p_values) > 1e-4, p_values


# --- C, D, E. One Speculate stream in-process: a bad session costs that session only, nothing leaks ----------


def refused(metrics: DraftMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("duo_draft:sessions_refused_total", {"reason": reason})


@pytest.mark.parametrize("fields, reason, words", [
    ({"committed": [1, 10**9]}, "invalid_event", ["token id 1000000000", "vocabulary"]),
    ({"committed": [1, -3]}, "invalid_event", ["token id -3"]),
    ({"committed": []}, "invalid_event", ["at least one committed token"]),
    ({"sampling": pb.SamplingParams(temperature=1.0, min_p=1.0)}, "invalid_event", ["min_p"]),
    ({"sampling": pb.SamplingParams(temperature=float("nan"))}, "invalid_event", ["temperature"]),
    ({"p_min": float("nan")}, "invalid_event", ["p_min"]),
    ({"max_ahead": 10**6}, "invalid_event", ["max_ahead"]),
    ({"committed": [11] * 64}, "model_error", ["does not fit", "--ctx-size"]),
], ids=["token beyond the vocabulary", "negative token", "no committed token", "min_p of 1",
        "temperature NaN", "p_min NaN", "max_ahead beyond the context", "prompt beyond the context"])
def test_a_session_the_draft_cannot_open_gets_a_session_error_and_the_others_go_on(draft_model, fields, reason,
                                                                                   words):
    model = CountingModel(draft_model)

    async def run() -> tuple[dict[int, str], int, DraftMetrics, bool]:
        servicer, metrics = servicer_for(model)
        stream = Stream(servicer)
        stream.open(1)
        stream.open(2, **fields)
        stream.open(3, sampling=SAMPLED)
        await stream.until(lambda: 2 in stream.errors() and len(stream.chunks(1)) == 4 and len(stream.chunks(3)) == 4)
        stream.send(commit=pb.Commit(session_id=1, start=3, tokens=[stream.chunks(1)[0].tokens[0] + 1]))
        await stream.until(lambda: len(stream.chunks(1)) == 8)  # session 1 drafts on after the bad open
        await stream.end()
        freed = await holds_nothing(servicer.drafter)
        await servicer.drafter.stop()
        return stream.errors(), servicer.sessions_open(), metrics, freed

    errors, still_open, metrics, freed = asyncio.run(run())
    assert list(errors) == [2]
    for word in words:
        assert word in errors[2]
    assert refused(metrics, reason) == 1
    assert still_open == 0 and freed
    assert (model.made, model.closed) == (1, 1)  # one context for all sessions, closed with the drafter


class Raising:
    """A random generator that raises `error` when drawn from."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def random(self) -> float:
        raise self.error


class FailingDrafter(Drafter):
    """Drawing session 2's tokens (in the batched call with the others) raises `FailingDrafter.error`, as a
    bug or a broken model would."""

    error: Exception = AssertionError("a bug")

    async def open(self, message: pb.OpenSession) -> DraftSession:
        session = await super().open(message)
        if session.session_id == 2:
            session.rng = Raising(self.error)
        return session


@pytest.mark.parametrize("error, reason", [
    (AssertionError("a bug"), "internal"),
    (ValueError("logits must be finite"), "internal"),
    (ModelError("llama_decode failed"), "model_error"),
], ids=["assertion", "value error", "model error"])
def test_a_session_whose_drafting_fails_gets_a_session_error_and_the_others_go_on(draft_model, error, reason):
    model = CountingModel(draft_model)

    class Failing(FailingDrafter):
        pass
    Failing.error = error

    async def run() -> tuple[dict[int, str], DraftMetrics, int, bool]:
        servicer, metrics = servicer_for(model, drafter_class=Failing)
        stream = Stream(servicer)
        for session_id in (1, 2, 3):
            stream.open(session_id, sampling=SAMPLED)
        await stream.until(lambda: 2 in stream.errors() and len(stream.chunks(1)) == len(stream.chunks(3)) == 4)
        held = slots_held(servicer.drafter)  # sessions 1 and 3; session 2's slot is freed at once
        stream.send(commit=pb.Commit(session_id=2, start=3, tokens=[5]))  # the target does not know yet: ignored
        stream.send(close=pb.CloseSession(session_id=2))
        stream.send(commit=pb.Commit(session_id=1, start=3, tokens=[stream.chunks(1)[0].tokens[0]]))
        await stream.until(lambda: len(stream.chunks(1)) == 5)
        await stream.end()
        freed = await holds_nothing(servicer.drafter)
        await servicer.drafter.stop()
        return stream.errors(), metrics, held, freed

    errors, metrics, held, freed = asyncio.run(run())
    assert errors == {2: str(error)}
    assert refused(metrics, reason) == 1
    assert held == 2 and freed


@pytest.mark.parametrize("event, reason, words", [
    ({"commit": pb.Commit(session_id=2, start=5, tokens=[11])}, "invalid_event", ["position 5", "3 tokens"]),
    ({"commit": pb.Commit(session_id=2, start=3, tokens=[11, 2**31 - 1])}, "invalid_event", ["token id 2147483647"]),
    ({"commit": pb.Commit(session_id=2, start=3, tokens=[11] * 61)}, "model_error", ["outgrew", "--ctx-size"]),
    ({"steer": pb.Steer(session_id=2, max_ahead=65)}, "invalid_event", ["max_ahead 65"]),
], ids=["commit leaving a gap", "commit of a token beyond the vocabulary", "commit beyond the context",
        "steer beyond the context"])
def test_a_bad_commit_or_steer_ends_its_session_alone(draft_model, event, reason, words):
    model = CountingModel(draft_model)

    async def run() -> tuple[dict[int, str], DraftMetrics, int, bool]:
        servicer, metrics = servicer_for(model)
        stream = Stream(servicer)
        stream.open(1)
        stream.open(2)
        await stream.until(lambda: len(stream.chunks(1)) == len(stream.chunks(2)) == 4)
        stream.send(**event)
        stream.send(commit=pb.Commit(session_id=1, start=3, tokens=[stream.chunks(1)[0].tokens[0] + 1]))
        await stream.until(lambda: 2 in stream.errors() and len(stream.chunks(1)) == 8)
        held = slots_held(servicer.drafter)
        await stream.end()
        freed = await holds_nothing(servicer.drafter)
        await servicer.drafter.stop()
        return stream.errors(), metrics, held, freed

    errors, metrics, held, freed = asyncio.run(run())
    assert list(errors) == [2] and all(word in errors[2] for word in words), errors
    assert refused(metrics, reason) == 1
    assert held == 1 and freed


def test_a_stream_cancelled_while_the_shared_context_is_being_made_leaves_it_to_the_drafter(draft_model):
    """Cancelling the coroutine that awaits a model call does not stop the call: the shared context is
    made after the stream is gone; it is the drafter's (the next session uses it), and no slot is taken."""
    model = CountingModel(draft_model, delay=0.2)

    async def run() -> tuple[bool, bool]:
        servicer, _ = servicer_for(model)
        stream = Stream(servicer)
        stream.open(1)
        await asyncio.to_thread(model.creating.wait, 5)
        stream.task.cancel()  # as grpc does when the target goes away
        await asyncio.gather(stream.task, return_exceptions=True)
        assert model.made == 0  # still being made
        await model.wait_until_made()
        gone = servicer.sessions_open() == 0 and not servicer.connections
        again = Stream(servicer)
        again.open(1)
        await again.until(lambda: len(again.chunks(1)) == 4)
        await again.end()
        freed = await holds_nothing(servicer.drafter)
        await servicer.drafter.stop()
        return gone, freed

    assert asyncio.run(run()) == (True, True)
    assert model.made == 1 and model.closed == 1


def test_a_close_waiting_behind_a_round_runs_even_if_the_stream_is_cancelled(draft_model):
    """A close queued on the model thread behind a slow round, then the stream cancelled: it still runs."""
    model = CountingModel(draft_model, delay=0.2)

    async def run() -> bool:
        servicer, _ = servicer_for(model)
        stream = Stream(servicer)
        stream.open(1)
        await asyncio.to_thread(model.decoding.wait, 5)  # a round is on the model thread
        stream.send(close=pb.CloseSession(session_id=1))
        await stream.until(lambda: not servicer.sessions_open())  # the close is queued
        stream.task.cancel()
        await asyncio.gather(stream.task, return_exceptions=True)
        freed = await holds_nothing(servicer.drafter)  # the release counts the cells free (it keeps them for a next turn)
        await servicer.drafter.stop()
        return freed

    assert asyncio.run(run())
    assert model.made == 1 and model.closed == 1


def test_sessions_beyond_the_per_target_or_total_cap_are_refused_until_one_closes(draft_model):
    metrics_of: dict[str, float] = {}

    async def run() -> tuple[dict[int, str], dict[int, str]]:
        servicer, metrics = servicer_for(draft_model, limits=SessionLimits(total=3, per_target=2))
        first, second = Stream(servicer), Stream(servicer)
        for session_id in (1, 2, 3):
            first.open(session_id)
        await first.until(lambda: 3 in first.errors() and len(first.chunks(2)) == 4)
        second.open(1)
        second.open(2)
        await second.until(lambda: 2 in second.errors() and len(second.chunks(1)) == 4)
        for name in ("duo_draft:num_sessions_open", "duo_draft:num_connections"):
            metrics_of[name] = metrics.registry.get_sample_value(name)
        first.send(close=pb.CloseSession(session_id=1))
        second.open(2)  # the freed place is taken
        await second.until(lambda: len(second.chunks(2)) == 4)
        for reason in ("max_sessions_per_target", "max_sessions"):
            metrics_of[reason] = refused(metrics, reason)
        errors = first.errors(), second.errors()
        await first.end()
        await second.end()
        await servicer.drafter.stop()
        return errors

    first_errors, second_errors = asyncio.run(run())
    assert list(first_errors) == [3] and "--max-sessions-per-target 2" in first_errors[3]
    assert list(second_errors) == [2] and "--max-sessions 3" in second_errors[2]
    assert metrics_of == {"duo_draft:num_sessions_open": 3, "duo_draft:num_connections": 2,
                          "max_sessions_per_target": 1, "max_sessions": 1}


# --- E, F. Through real processes: the caps and the draft's /metrics --------------------------------------


def test_beyond_its_session_cap_the_draft_refuses_and_the_target_decodes_alone_as_metrics_show(
        tiny_target, tiny_draft, served_alone, process_logs, target_model):
    metrics_port = free_port()
    draft = start("duo.cli.draft", ["--model", str(tiny_draft), "--max-sessions-per-target", "1",
                                        "--metrics", str(metrics_port)], process_logs)
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, "--draft-max", "4"],
                   process_logs)
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        wait_for_draft(target.address)
        expected = {prompt: generate(served_alone.address, prompt, max_tokens=200)[0] for prompt in PROMPTS}
        results: dict[str, list[int]] = {}
        threads = [threading.Thread(target=lambda p=p: results.setdefault(p, generate(target.address, p,
                                                                                          max_tokens=200)[0]))
                   for p in PROMPTS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results.keys() == expected.keys()
        for prompt, tokens in results.items():  # decoded together with the others: near-ties aside
            assert tokens == expected[prompt] or leaves_greedy_path_only_at_a_near_tie(target_model, prompt, tokens,
                                                                                        200), prompt
        metrics = scrape(url)
        assert metrics['duo_draft:sessions_refused_total{reason="max_sessions_per_target"}'] >= 1
        assert metrics["duo_draft:draft_tokens_total"] > 0 and metrics["duo_draft:chunks_sent_total"] > 0
        # A round draws for each session it decodes for at most two steps, its chain's and its branch's, and a step
        # one token, or after a guess of the context's one more than the guessed tokens its draws kept
        # (duo.draft.batch.draw_step): the guesses are what let a round draw more.
        assert 0 < metrics["duo_draft:round_seconds_count"] == metrics["duo_draft:sessions_per_round_count"]
        assert 2 * metrics["duo_draft:sessions_per_round_sum"] + metrics["duo_draft:guessed_tokens_kept_total"] >= \
            metrics["duo_draft:draft_tokens_total"]
        assert metrics["duo_draft:tokens_per_round_sum"] >= metrics["duo_draft:sessions_per_round_sum"]
        assert metrics["duo_draft:num_connections"] == 1
        deadline = time.monotonic() + 10
        while (after := scrape(url))["duo_draft:num_sessions_open"] or after["duo_draft:kv_cells_used"]:
            assert time.monotonic() < deadline, after
            time.sleep(0.05)
    finally:
        target.stop()
        draft.stop()
    assert "goes on without the draft (max_sessions_per_target)" in draft.log()


@pytest.mark.parametrize("flags, words", [
    (["--max-sessions", "0"], ["--max-sessions", "at least 1"]),
    (["--max-sessions-per-target", "0"], ["at least 1"]),
    (["--metrics", "not-an-address"], ["not HOST:PORT"]),
    (["--max-sessions", "129"], ["--max-sessions 129", "258 sequences", "256"]),
    (["--kv-cells", "1000", "--ctx-size", "2048"], ["--kv-cells 1000", "--ctx-size 2048"]),
], ids=["no sessions", "no sessions per target", "bad metrics address", "sequences beyond llama.cpp's",
        "fewer cells than a session's context"])
def test_duo_draft_refuses_flags_it_cannot_serve_before_loading_the_model(flags, words, capsys, tmp_path):
    assert main(["--model", str(tmp_path / "never-loaded.gguf"), *flags]) == 1
    error = capsys.readouterr().err
    assert all(word in error for word in words), error


async def a_target_that_stops_reading(servicer: DraftServicer):
    """A stream that opens a session, reads one event and never another, then sends commits that contradict the
    chain (the draft drafts again and queues more) until the draft gives it up, or 400 of them: the stream and
    its connection."""
    requests: asyncio.Queue[pb.TargetEvent | None] = asyncio.Queue()

    async def events():
        while (event := await requests.get()) is not None:
            yield event

    stream = servicer.Speculate(events(), Peer())
    requests.put_nowait(pb.TargetEvent(open=pb.OpenSession(session_id=1, committed=PROMPT, max_ahead=4)))
    await stream.__anext__()  # one event read; never another
    connection = next(iter(servicer.connections))
    for committed in range(len(PROMPT), len(PROMPT) + 400):
        if connection.overflowed:
            break
        requests.put_nowait(pb.TargetEvent(commit=pb.Commit(session_id=1, start=committed, tokens=[5])))
        await asyncio.sleep(0.005)
    return stream, connection


@pytest.mark.parametrize("limit", ["size", "stall"])
def test_a_target_that_sends_commits_but_never_reads_is_dropped_and_the_drafts_queue_stays_bounded(draft_model,
                                                                                                  monkeypatch, limit):
    if limit == "size":
        monkeypatch.setattr(service, "MAX_OUTBOX", 32)
    else:
        monkeypatch.setattr(service, "OUTBOX_STALL_S", 0.3)

    async def run() -> None:
        servicer, _ = servicer_for(draft_model, n_ctx=512)
        stream, connection = await a_target_that_stops_reading(servicer)
        assert connection.overflowed and connection.outbox.qsize() <= 2 and not connection.sessions  # the ends
        with pytest.raises(StopAsyncIteration):  # the stream ends when grpc next asks
            await stream.__anext__()
        await servicer.drafter.stop()

    asyncio.run(run())


class SlowRelease(Drafter):
    """Frees a session's sequences a while after being asked to; records which it has freed."""

    released: list[int]

    async def close(self, *sessions: DraftSession) -> None:
        await asyncio.sleep(0.2)
        await super().close(*sessions)
        self.released = getattr(self, "released", []) + [session.session_id for session in sessions]


def test_the_sessions_of_a_target_that_stopped_reading_are_freed_before_its_stream_ends(draft_model, monkeypatch):
    monkeypatch.setattr(service, "MAX_OUTBOX", 8)

    async def run() -> None:
        servicer, _ = servicer_for(draft_model, drafter_class=SlowRelease, n_ctx=512)
        stream, connection = await a_target_that_stops_reading(servicer)
        assert connection.overflowed
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        assert servicer.drafter.released == [1]  # released by the time the stream is gone, not some time later
        await servicer.drafter.stop()

    asyncio.run(run())


def test_a_link_idle_for_longer_than_the_stall_limit_is_not_taken_for_a_reader_that_stopped(monkeypatch):
    """An idle server (or a resting draft) sends nothing for a while; the next round's chunks, queued back to
    back, must not end the stream: a stall is an event left waiting, not a quiet link."""
    monkeypatch.setattr(service, "OUTBOX_STALL_S", 0.2)

    async def run() -> list[pb.DraftEvent]:
        connection = service.Connection(None, SessionLimits(), DraftMetrics(), lambda: 0, lambda: None,  # type: ignore[arg-type]
                                        "target")
        taking = asyncio.create_task(connection.next_event())  # grpc waits for the next event, as it does
        await asyncio.sleep(0.3)  # idle for longer than the stall limit
        for session_id in (1, 2):  # one round's chunks for two sessions of this target
            chunk = pb.DraftChunk(session_id=session_id, tokens=[7])
            await connection.deliver(Drafted(None, chunk))  # type: ignore[arg-type]
        assert not connection.overflowed
        return [await taking, await connection.next_event()]

    events = asyncio.run(run())
    assert [event.chunk.session_id for event in events] == [1, 2]


def test_while_drafting_the_draft_logs_its_sessions_and_tokens_now_and_then(draft_model, monkeypatch, caplog):
    monkeypatch.setattr(service, "ACTIVITY_LOG_S", 0.0)

    async def run() -> None:
        servicer, _ = servicer_for(draft_model)
        stream = Stream(servicer)
        stream.open(1)
        await stream.until(lambda: len(stream.chunks(1)) >= 2)
        await stream.end()
        await servicer.drafter.stop()

    with caplog.at_level("INFO", logger="duo.draft"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("drafting: ")]
    assert lines and "1 session(s) for 1 target(s)" in lines[0] and "tokens drafted in the last" in lines[0]
