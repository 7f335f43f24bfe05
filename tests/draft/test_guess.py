"""The draft guessing from the context (duo.draft.guess): a round decodes the lookup's guess with the chain and keeps
the tokens its own draws follow, so the chain is the one it drafts token by token (greedy: its own path; sampled:
each token drawn from the q it declares), in fewer rounds; the guess's length pays for its rows; the target turns
it on and off with its lookup."""

from __future__ import annotations

import asyncio

import numpy as np

from duo.net._proto import duo_pb2 as pb
from duo.costs import MovingAverage
from duo.draft.batch import Work, draw_step
from duo.draft.guess import GuessRate, guess_length
from duo.draft.session import DraftSession, Slot
from duo.draft.value import RoundCost
from duo.sampling.distributions import distribution
from duo.sampling.params import SamplingParams
from duo.target.generation import Generation
from duo.target.request import Request, SpecSettings
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.drafting import drafter_for
from helpers.lookup import catch_ups, dense
from helpers.stats import ALPHA, chi_square_pvalue

VOCAB = 8
PROMPT = [1, 2, 3, 4]


def session_for(params: SamplingParams, seed: int = 0) -> DraftSession:
    return DraftSession(session_id=1, chain=list(PROMPT), committed=len(PROMPT), params=params,
                        rng=np.random.default_rng(seed), max_ahead=8, p_min=0.0, slot=Slot(0, None), n_ctx=64)


def rows_favouring(*tokens: int) -> np.ndarray:
    """One logits row per token, each with that token far ahead of the rest."""
    rows = np.zeros((len(tokens), VOCAB), dtype=np.float32)
    rows[np.arange(len(tokens)), tokens] = 20.0
    return rows


def work_for(session: DraftSession, guess: tuple[int, ...]) -> Work:
    return Work(session, list(session.chain), epoch=0, commits=0, chain_len=len(session.chain), guess=guess)


def test_the_draws_keep_the_guess_while_they_equal_it_and_the_first_that_differs_ends_the_round():
    session = session_for(SamplingParams())  # greedy: each draw is its row's argmax
    step = draw_step(work_for(session, (5, 6, 7)), rows_favouring(5, 6, 0, 7))
    assert [token for token, _, _ in step.drawn] == [5, 6, 0]  # the draft's own token where the guess was wrong
    assert (step.guessed, step.kept, step.missed) == (3, 2, True)
    step = draw_step(work_for(session, (5, 6)), rows_favouring(5, 6, 3))
    assert [token for token, _, _ in step.drawn] == [5, 6, 3]  # followed to its end, and the token after it
    assert (step.kept, step.missed) == (2, False)
    step = draw_step(work_for(session, (5, 6)), rows_favouring(4, 6, 3))
    assert [token for token, _, _ in step.drawn] == [4] and step.missed  # rows after a wrong guess are not read


def test_sampled_draws_after_a_guess_are_each_drawn_from_their_rows_q():
    # Row 0 draws the first token; row 1 was computed as if the guess (token 2) came first, so it is read only
    # where the first draw is 2, and what it draws must then follow its own q, declared as sent.
    rng = np.random.default_rng(7)
    rows = rng.normal(0, 1, (2, VOCAB)).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    q0, q1 = (distribution(row, params) for row in rows)
    session = session_for(params, seed=3)
    first, second = np.zeros(VOCAB), np.zeros(VOCAB)
    for _ in range(6000):
        step = draw_step(work_for(session, (2,)), rows.copy())
        first[step.drawn[0][0]] += 1
        assert np.allclose(step.drawn[0][1].probs, q0.probs)
        if step.drawn[0][0] == 2:
            assert len(step.drawn) == 2 and np.allclose(step.drawn[1][1].probs, q1.probs)
            second[step.drawn[1][0]] += 1
        else:
            assert len(step.drawn) == 1
    assert chi_square_pvalue(first, dense(q0, VOCAB)) > ALPHA
    assert second.sum() > 300 and chi_square_pvalue(second, dense(q1, VOCAB)) > ALPHA


def test_a_guess_is_as_long_as_pays_for_its_rows():
    cost = RoundCost()
    for tokens, ratio in {1: 1.0, 2: 1.44, 3: 1.7, 4: 1.67, 5: 2.6, 6: 2.79, 7: 3.2, 8: 3.14, 9: 4.04}.items():
        cost.observe(tokens, 0.07 * ratio)  # 0.5B Q4_K_M on one Xeon core (the draft's T(n)/T(1))
    followed = guess_length(0.9, cost, tokens=1, most=8)
    assert followed == 3  # four rows cost 1.67 of one: up to 1 + .9 + .81 + .73 = 3.4 tokens for them
    assert guess_length(0.2, cost, tokens=1, most=8) == 0  # 1.2 tokens for 1.44: the draw alone
    assert guess_length(0.9, cost, tokens=1, most=2) == 2  # never past what the lookup proposes
    assert guess_length(0.9, cost, tokens=1, most=0) == 0


def test_a_sessions_guess_rate_learns_from_its_rounds_and_teaches_the_next_sessions():
    shared = MovingAverage(0.6, 1.0)
    rate = GuessRate(shared)
    for _ in range(20):
        rate.judge(0, missed=True)
    assert rate.own.value < 0.1 and shared.value < 0.1
    assert GuessRate(shared).own.value == shared.value
    rate.judge(3, missed=False)  # three followed, then the guess ended: no miss counted
    assert rate.own.value > 0.1


async def draft_with_every_draft_committed(drafter, message: pb.OpenSession, n: int) -> tuple[list[int], int, int]:
    """Rounds with a target that commits every drafted token (greedy drafts of its own path): the output, the
    rounds and the guessed tokens the draws kept."""
    session = await drafter.open(message)
    rounds = kept = 0
    while len(session.chain) - len(message.committed) < n:
        drafted = await drafter.draft_round([session])
        rounds += 1
        for result in drafted:
            assert result.error is None
        kept += sum(result.chunk is not None and len(result.chunk.tokens) > 1 for result in drafted)
        if len(session.chain) > session.committed:
            drafter.commit(session, session.committed, session.chain[session.committed:])
    await drafter.close(session)
    await drafter.stop()
    return session.chain[len(message.committed):][:n], rounds, kept


def test_a_draft_that_guesses_drafts_its_own_greedy_path_in_fewer_rounds(draft_model):
    prompt = draft_model.tokenize("def fibonacci(n):\n    return n\n\ndef fibonacci(")
    n = 64

    def run(lookup: bool):
        drafter = drafter_for(draft_model, n_ctx=256, top_k_cap=10)
        message = pb.OpenSession(session_id=1, committed=prompt, max_ahead=10, lookup=lookup)
        return asyncio.run(draft_with_every_draft_committed(drafter, message, n))

    guessed, rounds, multi = run(True)
    plain, plain_rounds, plain_multi = run(False)
    assert leaves_greedy_path_only_at_a_near_tie(draft_model, prompt, guessed, n)  # the draft's own tokens
    assert leaves_greedy_path_only_at_a_near_tie(draft_model, prompt, plain, n)
    assert plain_multi == 0 and plain_rounds >= n  # one token a round without the guess
    assert multi > 0 and rounds < plain_rounds  # the tiny draft repeats itself: its guesses are followed


def test_the_targets_lookup_setting_turns_the_drafts_guessing_on_and_off(target_model, draft_model):
    prompt = target_model.tokenize("hello")
    for lookup in (True, False):
        generation = Generation(1, Request(prompt, SamplingParams(), max_tokens=4), target_model,
                                SpecSettings(lookup=lookup))
        assert generation.open_message().lookup is lookup

        async def opened():
            drafter = drafter_for(draft_model, n_ctx=256, top_k_cap=10)
            session = await drafter.open(generation.open_message())
            await drafter.close(session)
            await drafter.stop()
            return session
        assert (asyncio.run(opened()).lookup is not None) is lookup


def test_the_draft_indexes_a_sessions_prompt_off_the_event_loop_when_it_opens_it(draft_model, monkeypatch):
    prompt = draft_model.tokenize("def area(r):\n    return 3.14 * r * r\n\n" * 60, add_special=False)
    seen = catch_ups(monkeypatch)

    async def open_and_draft() -> int:
        drafter = drafter_for(draft_model, n_ctx=2048, top_k_cap=10)
        session = await drafter.open(pb.OpenSession(session_id=1, committed=prompt, max_ahead=8, lookup=True))
        indexed = session.lookup.indexed
        await drafter.draft_round([session])  # its guess looks the prompt's end up
        await drafter.close(session)
        await drafter.stop()
        return indexed

    assert asyncio.run(open_and_draft()) == len(prompt)
    assert seen[0] == (False, len(prompt))
    assert len(seen) > 1 and all(on_loop and n == 0 for on_loop, n in seen[1:])
