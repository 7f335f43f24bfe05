"""Presence, frequency and repeat penalties and logit_bias, exact along the chain: each verified row is transformed
after the output before it (committed tokens and the drafts before that row), on the target and on the draft."""

from __future__ import annotations

import math

import numpy as np
import pytest

from duo.draft.batch import Work, draw_step
from duo.draft.session import DraftSession, Slot
from duo.net import wire
from duo.sampling import rows as pipeline
from duo.sampling.ops.penalties import OutputCounts, Penalties
from duo.sampling.params import SamplingParams
from duo.sampling.rows import transform
from helpers.greedy import leaves_transformed_greedy_path_only_at_a_near_tie
from helpers.http import post
from helpers.penalties import PROMPT_TEXT, answer
from helpers.scripted import ScriptedDraft


def test_the_transforms_follow_llama_cpp_and_openai():
    logits = np.array([2.0, -1.0, 0.5, 3.0, 0.0], dtype=np.float32)
    output = [0, 1, 0, 4]
    repeat = Penalties(repeat=2.0, repeat_last_n=2).apply(logits.copy(), output)  # the window: [0, 4]
    assert repeat.tolist() == [1.0, -1.0, 0.5, 3.0, 0.0]  # 2 / 2; 0 * 2; token 1 is out of the window
    counted = Penalties(presence=0.5, frequency=0.25).apply(logits.copy(), output)
    assert counted.tolist() == pytest.approx([2.0 - 0.5 - 0.5, -1.0 - 0.75, 0.5, 3.0, 0.0 - 0.75])
    biased = Penalties(bias=((3, -math.inf), (2, 2.0))).apply(logits.copy(), [])
    assert biased[3] == -np.inf and biased[2] == 2.5 and int(np.argmax(biased)) == 2
    assert not Penalties().active and not Penalties(repeat=1.3, repeat_last_n=0).active


def reference_transform(penalties: Penalties, logits: np.ndarray, output: list[int]) -> np.ndarray:
    """The transforms as llama.cpp and OpenAI define them, from the whole output at once (duo's first version)."""
    if penalties.bias:
        ids, values = zip(*penalties.bias)
        logits[list(ids)] += np.asarray(values, dtype=logits.dtype)
    if penalties.repeat != 1.0 and penalties.repeat_last_n and output:
        n = penalties.repeat_last_n
        window = np.unique(np.asarray(output[-n:] if n > 0 else output))
        seen = logits[window]
        logits[window] = np.where(seen > 0, seen / penalties.repeat, seen * penalties.repeat)
    if (penalties.presence or penalties.frequency) and output:
        ids, counts = np.unique(np.asarray(output), return_counts=True)
        logits[ids] -= (penalties.presence + penalties.frequency * counts).astype(logits.dtype)
    return logits


@pytest.mark.parametrize("repeat_last_n", [-1, 0, 3, 64])
def test_rows_penalized_from_counts_kept_at_each_commit_are_exactly_those_of_the_whole_output(repeat_last_n):
    rng = np.random.default_rng(repeat_last_n + 10)
    n_vocab = 50  # few tokens: outputs and drafts repeat them, and drafts repeat the output's
    penalties = Penalties(presence=0.7, frequency=-0.3, repeat=1.3, repeat_last_n=repeat_last_n,
                          bias=((3, -math.inf), (5, 2.5), (7, -0.1)))
    counted, output = OutputCounts(n_vocab), []
    for _ in range(30):  # steps: verify rows after the output and the drafts before each, then commit some
        drafts = rng.integers(0, n_vocab, rng.integers(0, 9)).tolist()
        rows = rng.normal(0, 3, (len(drafts) + 1, n_vocab)).astype(np.float32)  # negative and positive logits
        expected = np.array([reference_transform(penalties, row.copy(), output + drafts[:i])
                             for i, row in enumerate(rows)])
        transform(penalties, rows, output, drafts, counted)
        assert np.array_equal(rows, expected)
        committed = drafts[:rng.integers(0, len(drafts) + 1)] + rng.integers(0, n_vocab, 1).tolist()
        output += committed
        counted.extend(committed)
    assert counted.tokens == output and sorted(counted.distinct.tolist()) == sorted(set(output))


def test_a_large_logit_bias_is_read_into_arrays_once_not_on_every_row():
    class CountedPasses(tuple):
        passes = 0

        def __iter__(self):
            CountedPasses.passes += 1
            return super().__iter__()

    n_vocab = 1000
    penalties = Penalties(bias=CountedPasses([(token, 0.0) for token in range(n_vocab - 1)] + [(n_vocab - 1, 1.0)]))
    penalties.validate(n_vocab)
    logits = np.zeros(n_vocab, dtype=np.float32)
    penalties.apply(logits, [])
    before = CountedPasses.passes
    for _ in range(10):
        penalties.apply(logits, [1, 2])
    assert CountedPasses.passes == before and logits[-1] == 11.0 and not logits[:-1].any()


@pytest.mark.parametrize("penalties, field", [
    (Penalties(bias=((1, 0.0),) * 11), "logit_bias"),  # more entries than the vocabulary has tokens
    (Penalties(bias=tuple((token, -math.inf) for token in range(10))), "logit_bias"),  # nothing left to generate
    (Penalties(bias=((2**70, 1.0),)), "logit_bias"),
    (Penalties(bias=((1, math.nan),)), "logit_bias"),
    (Penalties(repeat=1.1, repeat_last_n=2**31), "repeat_last_n"),  # past the wire's int32
    (Penalties(repeat_last_n=-2), "repeat_last_n"),
], ids=["more entries than tokens", "every token banned", "id past int64", "NaN value", "repeat_last_n 2^31",
        "repeat_last_n -2"])
def test_validation_bounds_the_bias_and_the_window_by_name(penalties, field):
    with pytest.raises(ValueError, match=field):
        penalties.validate(10)


def test_the_largest_valid_window_and_a_bias_on_every_token_but_one_travel_to_the_draft():
    penalties = Penalties(repeat=1.25, repeat_last_n=2**31 - 1, bias=tuple((token, -math.inf) for token in range(9)))
    penalties.validate(10)
    assert wire.penalties_from_pb(wire.sampling_to_pb(SamplingParams(), None, penalties)) == penalties


def test_penalties_travel_to_the_draft_whole():
    penalties = Penalties(presence=0.5, frequency=-0.25, repeat=1.25, repeat_last_n=-1, bias=((7, -math.inf), (9, 2.0)))
    message = wire.sampling_to_pb(SamplingParams(), None, penalties)
    assert wire.penalties_from_pb(message) == penalties
    assert wire.penalties_from_pb(wire.sampling_to_pb(SamplingParams(), None)) == Penalties()


def test_greedy_output_under_penalties_is_the_targets_own_and_a_right_draft_only_speeds_it(target_model):
    prompt = target_model.tokenize(PROMPT_TEXT)
    plain, _ = answer(target_model, prompt, Penalties())
    banned = plain[0]
    penalties = Penalties(repeat=1.5, repeat_last_n=16, presence=0.5, bias=((banned, -math.inf),))
    alone, _ = answer(target_model, prompt, penalties)
    assert alone != plain and banned not in alone  # the transforms change what the target says
    assert len(set(alone)) > len(set(plain))  # repeating costs: more distinct words

    def right(committed: list[int]) -> list[int]:
        done = len(committed) - len(prompt)
        return alone[done:done + 8]

    tokens, records = answer(target_model, prompt, penalties, ScriptedDraft(right))
    assert leaves_transformed_greedy_path_only_at_a_near_tie(target_model, prompt, tokens, 24, penalties.apply)
    assert sum(r.n_accepted for r in records) > len(alone) / 2


def test_a_verifier_that_ignores_the_drafts_history_is_caught(target_model, monkeypatch):
    """Mutation: rows transformed after the committed output alone (not the drafts before them) leave the path."""
    prompt = target_model.tokenize(PROMPT_TEXT)
    penalties = Penalties(repeat=3.0, repeat_last_n=-1, frequency=1.0)
    alone, _ = answer(target_model, prompt, penalties)

    def right(committed: list[int]) -> list[int]:
        done = len(committed) - len(prompt)
        return alone[done:done + 8]

    monkeypatch.setattr(pipeline, "penalize_rows",
                        lambda p, rows, committed, drafts, counted: [p.apply(row, [], counted) for row in rows])
    tokens, _ = answer(target_model, prompt, penalties, ScriptedDraft(right))
    assert not leaves_transformed_greedy_path_only_at_a_near_tie(target_model, prompt, tokens, 24, penalties.apply)


def test_the_draft_applies_the_penalties_to_what_it_draws(target_model):
    prompt = target_model.tokenize(PROMPT_TEXT)
    favourite = np.zeros(target_model.n_vocab, dtype=np.float32)
    favourite[100], favourite[200] = 5.0, 4.0
    session = DraftSession(session_id=1, chain=list(prompt), committed=len(prompt), params=SamplingParams(),
                           rng=np.random.default_rng(0), max_ahead=8, p_min=0.0, slot=Slot(0, None), n_ctx=256,
                           output_start=len(prompt), penalties=Penalties(presence=2.0))
    tokens = prompt + [100]  # token 100 is in the output: its 5.0 becomes 3.0, below 200's 4.0
    assert draw_step(Work(session, tokens, epoch=0, commits=0, chain_len=len(tokens)), favourite.copy()[None]).drawn[0][0] == 200
    assert draw_step(Work(session, prompt, epoch=0, commits=0, chain_len=len(prompt)), favourite.copy()[None]).drawn[0][0] == 100


def test_the_draft_counts_its_committed_output_once_and_penalizes_each_draw_as_after_the_whole_output():
    rng = np.random.default_rng(3)
    n_vocab, prompt = 40, [1, 2, 3]
    penalties = Penalties(presence=0.5, frequency=0.25, repeat=1.5, repeat_last_n=-1, bias=((0, -math.inf),))
    session = DraftSession(session_id=1, chain=list(prompt), committed=len(prompt), params=SamplingParams(),
                           rng=rng, max_ahead=8, p_min=0.0, slot=Slot(0, None), n_ctx=4096,
                           output_start=len(prompt), penalties=penalties)
    committed = list(prompt)
    for _ in range(25):  # a work planned after each commit: the committed tokens, then drafts and a guess's
        tokens = committed + rng.integers(0, n_vocab, rng.integers(0, 6)).tolist()
        guess = tuple(rng.integers(0, n_vocab, rng.integers(0, 3)).tolist())
        rows = rng.normal(0, 3, (len(guess) + 1, n_vocab)).astype(np.float32)
        work = Work(session, tokens, epoch=0, commits=0, chain_len=len(tokens), guess=guess, committed=len(committed))
        transformed = rows.copy()  # draw_step transforms each row it draws from in place
        step = draw_step(work, transformed)
        assert step.error is None and step.drawn
        for j in range(len(step.drawn)):
            after = tokens[len(prompt):] + list(guess[:j])
            assert np.array_equal(transformed[j], reference_transform(penalties, rows[j].copy(), after))
        committed = tokens[:rng.integers(len(committed), len(tokens) + 1)] + rng.integers(1, n_vocab, 1).tolist()
    assert session.output_counts.tokens == committed[len(prompt):len(session.output_counts.tokens) + len(prompt)]


def test_openai_and_llama_server_penalty_fields_are_honoured_over_http(served_sync, target_model):
    base = {"prompt": PROMPT_TEXT, "max_tokens": 16, "temperature": 0}
    plain = post(served_sync, "/v1/completions", base).json()["choices"][0]["text"]
    first = target_model.tokenize(plain, add_special=False)[0]
    for bias in ({str(first): -100}, [[first, False]]):
        body = post(served_sync, "/v1/completions", {**base, "logit_bias": bias}).json()
        assert first not in target_model.tokenize(body["choices"][0]["text"], add_special=False)
    penalized = post(served_sync, "/completion", {"prompt": PROMPT_TEXT, "n_predict": 16, "temperature": 0,
                                                  "repeat_penalty": 1.5, "repeat_last_n": 16,
                                                  "presence_penalty": 0.5, "frequency_penalty": 0.5}).json()
    assert penalized["content"] != plain and penalized["timings"]["draft_n_accepted"] > 0
    for field, value in (("presence_penalty", 3), ("repeat_penalty", 0), ("logit_bias", {"-1": 1}),
                         ("logit_bias", [[1.5, 1]])):
        response = post(served_sync, "/v1/completions", {**base, field: value})
        assert response.status_code == 400 and field.split("_")[0] in response.json()["error"]["message"], response.text
