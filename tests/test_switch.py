"""duo.switch: speculation stays on only where it delivers more tokens per wall second than decoding alone,
measured in periods of both regimes; while off the draft rests, and the trials grow rarer."""

from __future__ import annotations

import pytest

from duo.policy import AdaptivePolicy
from duo.switch import MARGIN, MAX_DOUBLINGS, ON_STEPS, PROBE_LEAD, TRIAL_STEPS, Switch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(switch: Switch, clock: Clock, steps: int, on_rate: float, off_rate: float, request: int = 1) -> list[bool]:
    """`steps` steps of one token each, taking 1 / rate seconds in the regime the switch is in; the regime
    of each step."""
    regimes = []
    for _ in range(steps):
        regimes.append(switch.speculating)
        clock.now += 1 / (on_rate if switch.speculating else off_rate)
        switch.step_done(request, 1, verified=1 if switch.speculating else 0)
    return regimes


def fresh(clock: Clock) -> Switch:
    switch = Switch(clock=clock)
    switch.step_done(1, 1)  # a request's first step (its prompt's prefill) is not counted
    return switch


def test_where_speculation_pays_it_stays_on_but_for_a_short_check_now_and_then():
    clock = Clock()
    switch = fresh(clock)
    regimes = run(switch, clock, 3 * (ON_STEPS + TRIAL_STEPS), on_rate=15.0, off_rate=10.0)
    assert switch.gain == pytest.approx(1.5)
    assert regimes.count(False) <= 4 * TRIAL_STEPS  # the first off measurement, then one per ON_STEPS
    assert regimes[-ON_STEPS // 2:] == [True] * (ON_STEPS // 2)


def test_where_speculation_does_not_pay_the_draft_rests_and_the_trials_grow_rarer():
    clock = Clock()
    switch = fresh(clock)
    steps = TRIAL_STEPS * (2 + 2 ** (MAX_DOUBLINGS + 3))
    regimes = run(switch, clock, steps, on_rate=9.8, off_rate=10.0)
    assert switch.gain < 1
    trials = [i for i in range(1, steps) if regimes[i] and not regimes[i - 1]]
    gaps = [b - a for a, b in zip(trials, trials[1:])]
    assert gaps == sorted(gaps) and gaps[0] < gaps[-1]  # each lost trial doubles the rest before the next
    assert gaps[-1] == TRIAL_STEPS * (2 ** MAX_DOUBLINGS + 2)  # ... up to a cap (rest, trial, judging period)
    assert regimes.count(True) < 0.15 * steps


def test_speculation_must_beat_decoding_alone_by_the_margin_to_stay_on():
    clock = Clock()
    switch = fresh(clock)
    run(switch, clock, 2 * TRIAL_STEPS, on_rate=10.0 * (1 + MARGIN / 2), off_rate=10.0)
    assert not switch.speculating  # a gain within the margin does not keep the draft busy
    clock, switch = Clock(), None
    switch = fresh(clock)
    run(switch, clock, 2 * TRIAL_STEPS, on_rate=10.0 * (1 + 2 * MARGIN), off_rate=10.0)
    assert switch.speculating


def test_a_change_of_regime_is_noticed():
    """Content or load changes: a target where speculation paid stops paying; the next check turns it off."""
    clock = Clock()
    switch = fresh(clock)
    run(switch, clock, 2 * TRIAL_STEPS, on_rate=15.0, off_rate=10.0)
    assert switch.speculating
    run(switch, clock, ON_STEPS + TRIAL_STEPS, on_rate=8.0, off_rate=10.0)
    assert not switch.speculating and switch.gain < 1


def test_each_requests_steps_are_timed_from_its_own_previous_step():
    clock = Clock()
    switch = Switch(clock=clock)
    switch.step_done(1, 1)
    clock.now = 5.0
    switch.step_done(2, 1)  # request 2's first step: not counted, whatever it waited
    clock.now = 5.5
    switch.step_done(1, 3, verified=2)  # 3 tokens in the 5.5 s since request 1's previous step
    switch.step_done(2, 1, verified=1)  # 1 token in 0.5 s
    assert (switch._tokens, switch._seconds) == (4, 6.0)
    switch.request_done(1)
    clock.now = 9.0
    switch.step_done(1, 1, verified=1)  # a new request with a reused id starts afresh
    assert switch._tokens == 4


def test_while_off_the_policy_rests_the_draft_and_leads_it_into_the_next_trial():
    clock = Clock()
    switch = fresh(clock)
    policy = AdaptivePolicy(max_draft=8, switch=switch)
    run(switch, clock, 2 * TRIAL_STEPS, on_rate=9.0, off_rate=10.0)
    assert not switch.speculating
    leads = []
    while not switch.speculating:
        assert policy.choose(4) == 0  # nothing drafted, nothing explored
        leads.append(policy.max_ahead())
        clock.now += 0.1
        switch.step_done(1, 1)
    assert leads[-PROBE_LEAD:] == [2] * PROBE_LEAD and set(leads[:-PROBE_LEAD]) == {0}


def test_an_on_period_is_timed_from_the_first_step_that_verified_drafts():
    """After a rest the draft first catches up on the tokens committed meanwhile: those steps (alone, at
    the off rate) are the trial's entry cost, not what speculation delivers."""
    clock = Clock()
    switch = fresh(clock)
    switch._go(True, TRIAL_STEPS)
    for _ in range(10):  # catching up: alone, slowly
        clock.now += 0.1
        switch.step_done(1, 1, verified=0)
    assert (switch._tokens, switch.steps_left) == (0, TRIAL_STEPS)
    run(switch, clock, TRIAL_STEPS, on_rate=15.0, off_rate=10.0)
    assert switch.on_rate == pytest.approx(15.0, rel=0.05)
    # a draft that never delivers is judged all the same, after TRIAL_STEPS left out
    switch._go(True, TRIAL_STEPS)
    for _ in range(2 * TRIAL_STEPS + 1):
        clock.now += 0.1
        switch.step_done(1, 1, verified=0)
    assert not switch.speculating and switch.on_rate == pytest.approx(10.0)
