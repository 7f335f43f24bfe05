"""The simulated pool (duo.bench.pool_sim): its target, drafts and links act as specified; placement is the pool's."""

from __future__ import annotations

import math

import pytest

from duo.bench.pool_sim import DraftSpec, alone, best_k, simulate

FLAT = {1: 0.1, 64: 0.1}                              # a call costs the same whatever it holds
INSTANT = {1: 0.0, 8: 0.0}                            # a draft whose rounds take no time
RISING = {1: 0.1, 2: 0.17, 5: 0.21, 9: 0.27, 72: 1.6}  # T(n) of the F16 target on a CPU core, roughly
CPU_DRAFT = {1: 0.016, 2: 0.022, 4: 0.034, 8: 0.06}


@pytest.mark.parametrize("k", [1, 3, 6])
def test_an_instant_draft_always_right_commits_k_plus_one_a_step_after_the_first(k: int) -> None:
    tokens = 100
    outcome = simulate(2, tokens, FLAT, [DraftSpec("d", INSTANT, acceptance=1.0, link_s=0.0)], k)
    steps = 1 + math.ceil((tokens - 1) / (k + 1))  # the first call finds no drafts yet: it commits one
    assert outcome.seconds == pytest.approx(steps * FLAT[1])
    assert outcome.starved_share == pytest.approx(1 / steps)


def test_the_target_alone_commits_one_token_a_call_per_session() -> None:
    outcome = alone(4, 50, RISING)
    assert outcome.seconds == pytest.approx(50 * (0.17 + (0.21 - 0.17) * 2 / 3))  # 50 calls of T(4), interpolated
    assert outcome.tokens_per_second == pytest.approx(4 * 50 / outcome.seconds)


@pytest.mark.parametrize("clients", [1, 2, 4])
def test_drafts_never_accepted_are_never_faster_than_the_target_alone(clients: int) -> None:
    base = alone(clients, 60, RISING)
    for k in (1, 4, 8):
        for seed in range(3):
            wrong = simulate(clients, 60, RISING, [DraftSpec("d", CPU_DRAFT, acceptance=0.0)], k, seed)
            assert wrong.tokens_per_second <= base.tokens_per_second * (1 + 1e-9)


def test_drafts_accepted_as_measured_beat_the_target_alone_at_one_client() -> None:
    duo = best_k(1, 100, RISING, [DraftSpec("d", CPU_DRAFT, acceptance=0.85)], seeds=3)
    assert duo.tokens_per_second > 1.3 * alone(1, 100, RISING).tokens_per_second


def test_two_equal_drafts_split_four_clients_two_and_two_and_are_no_slower_than_one() -> None:
    slow = {m: 4 * s for m, s in CPU_DRAFT.items()}  # slow enough that one draft for four sessions holds them up
    one = best_k(4, 100, RISING, [DraftSpec("a", slow, 0.85)], seeds=4)
    two = best_k(4, 100, RISING, [DraftSpec("a", slow, 0.85), DraftSpec("b", slow, 0.85)], seeds=4)
    assert two.placed == {"a": 2, "b": 2}
    assert two.tokens_per_second >= one.tokens_per_second


@pytest.mark.parametrize("seed", [0, 1])
def test_a_draft_slower_than_the_target_ends_up_with_fewer_sessions_than_a_fast_one(seed: int) -> None:
    # d(1) = 1.2 T(1), a round's cost in proportion to its sessions: still faster than a step of four sessions,
    # so that the target sees two of its chunks between commits and times its pace (as duo.target.generation).
    slow = {m: 1.2 * m * RISING[1] for m in (1, 8)}
    drafts = [DraftSpec("slow", slow, 0.85), DraftSpec("fast", CPU_DRAFT, 0.85)]
    outcome = simulate(4, 400, RISING, drafts, k=4, seed=seed)
    assert outcome.placed == {"slow": 2, "fast": 2}  # nothing measured yet: spread evenly
    assert outcome.moves >= 1
    assert outcome.mean_sessions["slow"] < outcome.mean_sessions["fast"]
