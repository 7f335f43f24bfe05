"""duo.target.switch: speculation judged by the tokens per wall second it delivers, against decoding alone."""

from __future__ import annotations

import pytest

from duo.cli.generate import format_stats
from duo.costs import StepCosts
from duo.net._proto import duo_pb2 as pb
from duo.target import switch as sw
from duo.target.policy import AdaptivePolicy
from duo.target.request import GenerationStats
from duo.target.switch import Switch
from helpers.clock import Clock, rests_of


def run(switch: Switch, clock: Clock, steps: int, *, on_tokens: float, alone_s: float,
        alone_every: int = 3, beside_draft_s: float | None = None, context: int = 0) -> list[bool]:
    """Drive `steps` steps of one request after `context` tokens and return whether each ran speculating.

    While on, every `alone_every`-th step decodes alone (1 token in `beside_draft_s`, default alone_s: the
    draft works beside it), the others verify drafts and commit tokens at `on_tokens` per second; while
    off, a step takes `alone_s`."""
    regimes = []
    for i in range(steps):
        speculating = switch.speculating
        regimes.append(speculating)
        if not speculating:
            clock.now += alone_s
            switch.step_done(1, 1, 0, context=context)
        elif i % alone_every == 0:
            clock.now += beside_draft_s if beside_draft_s is not None else alone_s
            switch.step_done(1, 1, 0, context=context)
        else:
            clock.now += 3 / on_tokens
            switch.step_done(1, 3, 3, context=context)
    return regimes


def test_speculation_that_pays_stays_on_and_rests_the_draft_only_to_measure_decoding_alone_ever_more_rarely():
    clock = Clock()
    switch = Switch(clock=clock)
    regimes = run(switch, clock, 6000, on_tokens=8.0, alone_s=0.2)  # alone 5 tok/s
    assert switch.established and switch.gain is not None and switch.gain > 1.3
    assert switch.reason().startswith("on (")
    measures = rests_of(regimes)
    assert set(measures) == {sw.MEASURE_STEPS}  # every stretch off only measures
    gaps = [i for i in range(1, len(regimes)) if regimes[i - 1] and not regimes[i]]  # where each measure starts
    spacing = [later - earlier for earlier, later in zip(gaps, gaps[1:])]
    assert spacing and all(later >= earlier for earlier, later in zip(spacing, spacing[1:])), spacing  # rarer
    assert regimes.count(False) / len(regimes) < 0.03


def test_speculation_below_decoding_alone_is_switched_off_and_trials_come_exponentially_rarer():
    clock = Clock()
    switch = Switch(clock=clock)
    regimes = run(switch, clock, 4000, on_tokens=9.5, alone_s=0.1)  # alone 10 tok/s: on is 0.95x or less
    on_share = sum(regimes) / len(regimes)
    assert on_share < 0.15, on_share
    rests = rests_of(regimes)  # the first measures decoding alone, then rests: they double
    assert len(rests) >= 3 and rests[0] == sw.MEASURE_STEPS + sw.REST_STEPS
    assert rests[1] == 2 * sw.REST_STEPS and rests[2] == 4 * sw.REST_STEPS
    assert switch.reason().startswith("off (")


def test_decoding_alone_is_measured_with_the_draft_resting_not_from_the_steps_alone_beside_it():
    """On one core shared (or two hyperthreads of one), a step decoded alone while the draft works takes twice
    as long: against those, speculation at 0.7x decoding alone would "win" 1.4x and stay on for good."""
    clock = Clock()
    switch = Switch(clock=clock)
    regimes = run(switch, clock, 3000, on_tokens=7.0, alone_s=0.1, beside_draft_s=0.2)
    assert sum(regimes) / len(regimes) < 0.15 and switch.gain == pytest.approx(0.7, rel=0.1)


def test_a_trial_must_beat_decoding_alone_by_the_margin_but_an_established_regime_only_match_it():
    clock = Clock()
    trial = Switch(clock=clock, rest_rates={1: 10.0})
    # 2% better than alone overall: not enough to turn on from a trial.
    run(trial, clock, sw.TRIAL_STEPS + 2, on_tokens=10.3, alone_s=0.1, alone_every=10 ** 9)
    assert not trial.speculating

    clock = Clock()
    established = Switch(clock=clock)
    run(established, clock, 300, on_tokens=20.0, alone_s=0.1)
    assert established.established
    # The content changes: now only 2% above decoding alone. It stays on (hysteresis), but to measure.
    regimes = run(established, clock, 300, on_tokens=10.3, alone_s=0.1, alone_every=10 ** 9)
    assert established.speculating and established.established and rests_of(regimes) in ([], [sw.MEASURE_STEPS])


def test_speculation_comes_back_on_when_a_trial_finds_that_it_pays_again():
    clock = Clock()
    switch = Switch(clock=clock)
    run(switch, clock, 200, on_tokens=8.0, alone_s=0.1)  # does not pay: off
    assert not switch.speculating
    regimes = run(switch, clock, 1000, on_tokens=30.0, alone_s=0.1)  # the draft got good (say, code)
    assert switch.speculating and switch.established and sum(regimes[-300:]) >= 300 - sw.MEASURE_STEPS


def test_a_trials_catch_up_steps_are_left_out_of_its_rate():
    clock = Clock()
    switch = Switch(clock=clock, rest_rates={1: 10.0})  # decoding alone measured at 10 tok/s
    switch.step_done(1, 1, 0)  # the first step: holds the prompt, not timed
    for _ in range(sw.JUDGE_STEPS - 1):  # the draft catches up: these steps decode alone, slowly
        clock.now += 0.5
        switch.step_done(1, 1, 0)
    for _ in range(sw.TRIAL_STEPS - 1):  # then speculation delivers 20 tok/s
        clock.now += 0.1
        switch.step_done(1, 2, 2)
    assert switch.speculating and switch.gain is None
    clock.now += 0.1
    switch.step_done(1, 2, 2)
    assert switch.speculating and switch.gain is not None and abs(switch.gain - 2.0) < 0.01


def test_the_first_judgement_measures_decoding_alone_first_with_the_draft_idle():
    clock = Clock()
    switch = Switch(clock=clock)
    run(switch, clock, sw.TRIAL_STEPS + 2, on_tokens=30.0, alone_s=0.1, alone_every=10 ** 9)
    assert not switch.speculating and switch.reason() == "off (measuring decoding alone)"
    assert not switch.draft_wanted()  # the judging rest measures decoding with the draft idle
    regimes = run(switch, clock, 200, on_tokens=30.0, alone_s=0.1, alone_every=10 ** 9)
    assert sum(regimes[-100:]) >= 100 - sw.MEASURE_STEPS and switch.gain is not None and switch.gain > 2.5


def test_each_requests_first_step_and_steps_without_a_draft_are_not_timed():
    clock = Clock()
    switch = Switch(clock=clock, speculating=False, steps_left=2)
    clock.now = 100.0
    switch.step_done(7, 1, 0)  # 100 s since nothing: not a step's time
    clock.now += 0.1
    switch.step_done(7, 1, 0)
    switch.request_done(7)  # e.g. the draft went away
    clock.now += 50.0
    switch.step_done(7, 1, 0)  # the first step again
    clock.now += 0.1
    switch.step_done(7, 1, 0)
    assert switch.rest_rates == {1: pytest.approx(10.0)} and switch.speculating  # the rest ended: a trial


def test_the_policy_rests_the_draft_entirely_while_the_switch_is_off_and_leads_into_a_trial():
    costs = StepCosts()
    for n in range(1, 10):
        costs.observe(n, 0.1 * (1 + 0.05 * (n - 1)))  # memory-bound: the cost model wants long drafts
    switch = Switch(speculating=False, steps_left=sw.REST_STEPS)
    policy = AdaptivePolicy(8, costs, switch=switch)
    assert policy.max_ahead() == 0 and policy.draft_len == 0
    assert policy.choose(8) == 0  # decodes alone, explorations included
    for _ in range(3 * 16):
        assert policy.choose(8) == 0 and policy.max_ahead() == 0
    switch.steps_left = sw.PROBE_LEAD
    assert policy.max_ahead() > 2  # leads into the trial at the length it will want
    switch.speculating = True
    assert policy.choose(8) > 2 and policy.max_ahead() > 2


def test_a_new_request_wants_drafts_from_its_first_step():
    costs = StepCosts()
    for n in range(1, 10):
        costs.observe(n, 0.1 * (1 + 0.05 * (n - 1)))
    policy = AdaptivePolicy(8, costs)
    assert policy.draft_len > 0 and policy.max_ahead() > 2
    off = AdaptivePolicy(8, costs, switch=Switch(speculating=False, steps_left=sw.REST_STEPS))
    assert off.max_ahead() == 0


def test_the_reason_shows_in_a_requests_stats_line_and_in_the_targets_log_line():
    clock = Clock()
    switch = Switch(clock=clock)
    run(switch, clock, 200, on_tokens=8.0, alone_s=0.1)
    reason = switch.reason()
    assert reason.startswith("off (0.") and "decoding alone; next trial in" in reason
    assert format_stats(pb.Stats(generated_tokens=5, verify_steps=5, speculation=reason)).endswith(
        f"; speculation {reason}]")
    stats = GenerationStats(generated_tokens=5, verify_steps=5, speculation=reason)
    assert stats.log_line("stop").endswith(f"speculation {reason}")


def test_a_trial_that_clearly_loses_is_cut_short_but_an_established_regime_is_judged_on_whole_periods():
    clock = Clock()
    switch = Switch(clock=clock, rest_rates={1: 10.0})
    switch.step_done(1, 1, 0)
    for _ in range(sw.EARLY_STEPS):
        clock.now += 0.2
        switch.step_done(1, 1, 1)  # 5 tok/s against 10 alone
    assert not switch.speculating and switch.gain == pytest.approx(0.5)

    clock = Clock()
    established = Switch(clock=clock, rest_rates={1: 10.0}, established=True, steps_left=sw.JUDGE_STEPS)
    established.step_done(1, 1, 0)
    for _ in range(sw.JUDGE_STEPS - 1):
        clock.now += 0.2
        established.step_done(1, 1, 1)
    assert established.speculating  # a bad stretch of an established regime waits for its whole period


def test_the_first_trial_is_never_cut_short_while_the_target_still_learns():
    clock = Clock()
    switch = Switch(clock=clock)
    switch.step_done(1, 1, 0)
    for _ in range(sw.TRIAL_STEPS - 1):
        clock.now += 0.2
        switch.step_done(1, 1, 1)  # a slow start, before decoding alone was ever measured
    assert switch.speculating


def run_clients(switch: Switch, clock: Clock, rounds: int, clients: range, *, on_tokens: float,
                alone_s: float) -> list[bool]:
    """`rounds` batched calls of `clients` at once. Decoding alone, each request commits one token per call
    of `alone_s`; speculating, three per call, at `on_tokens` per request and wall second."""
    regimes = []
    for _ in range(rounds):
        speculating = switch.speculating
        regimes.append(speculating)
        clock.now += 3 / on_tokens if speculating else alone_s
        for request in clients:
            switch.step_done(request, 3 if speculating else 1, 3 if speculating else 0)
    return regimes


def test_a_reference_measured_under_heavy_load_does_not_make_a_light_load_win():
    """4 clients at 0.25 s a call, speculation at 0.9x: off, decoding alone measured at that load. Then one
    client at 0.1 s a token, speculation still 0.9x: it must not turn on for good against the old reference
    (before: on for 2000 of 2000 steps, "gain" 2.25x)."""
    clock = Clock()
    switch = Switch(clock=clock)
    run_clients(switch, clock, 400, range(1, 5), on_tokens=0.9 * 4, alone_s=0.25)
    assert not switch.speculating and switch.gain == pytest.approx(0.9, rel=0.02)
    for request in range(1, 5):
        switch.request_done(request)
    regimes = run(switch, clock, 2000, on_tokens=0.9 * 10, alone_s=0.1)
    assert sum(regimes) / len(regimes) < 0.15 and switch.gain < 1.0, (sum(regimes), switch.gain)


def test_steps_that_carry_a_prompt_chunk_count_in_neither_rate():
    """Decoding alone measured while other requests' prompts are decoded in the same calls would look slow,
    and speculation at 0.9x would look like a gain."""
    clock = Clock()
    switch = Switch(clock=clock)
    regimes = []
    for i in range(3000):
        speculating = switch.speculating
        regimes.append(speculating)
        if speculating:
            clock.now += 3 / 9.0  # 0.9x decoding alone
            switch.step_done(1, 3, 3)
        elif i % 2:
            clock.now += 1.0  # this call also decoded another request's prompt chunk
            switch.step_done(1, 1, 0, prefill=True)
        else:
            clock.now += 0.1
            switch.step_done(1, 1, 0)
    assert sum(regimes) / len(regimes) < 0.15 and switch.rest_rates[1] == pytest.approx(10.0)


def test_a_trial_with_several_clients_counts_each_from_its_own_first_drafts():
    """After a rest, each client's draft catches up before it delivers, the shortest first: steps of a client
    still catching up are not speculation's rate, even once another client delivers."""
    clock = Clock()
    switch = Switch(clock=clock, rest_rates={4: 4.0})  # decoding alone: 4 tok/s per request with 4 clients
    catch_up = {1: 5, 2: 10, 3: 20, 4: 40}  # rounds before each client's first verified drafts
    regimes = []
    for round_ in range(300):
        regimes.append(switch.speculating)
        if not switch.speculating:  # measuring decoding alone again: 4 tok/s per request
            clock.now += 0.25
            for request in catch_up:
                switch.step_done(request, 1, 0)
            continue
        clock.now += 0.5
        for request, rounds in catch_up.items():
            delivering = round_ >= rounds
            switch.step_done(request, 3 if delivering else 1, 3 if delivering else 0)
    assert switch.established and switch.gain == pytest.approx(1.5, rel=0.02)
    assert set(rests_of(regimes)) <= {sw.MEASURE_STEPS // len(catch_up)}  # off only to measure, never judged off


def test_a_loads_first_reference_is_estimated_from_model_time_instead_of_a_measuring_rest():
    """Four clients and no reference at that load: with an estimate of decoding alone there (1 / T(4) from the
    calls the target timed), the first judgement uses it and the draft never rests to measure; speculation that
    loses against it still goes off. Without an estimate, a measuring rest comes first (as before)."""
    def first_stretch_off(estimate, on_tokens):
        clock = Clock()
        switch = Switch(clock=clock, rest_rates={1: 10.0}, estimate_alone=estimate)
        regimes = run_clients(switch, clock, 60, range(1, 5), on_tokens=on_tokens, alone_s=0.25)
        return switch, regimes

    switch, regimes = first_stretch_off(lambda load: 4.0 if load == 4 else None, on_tokens=6.0)
    assert all(regimes) and switch.established and switch.gain == pytest.approx(1.5, rel=0.02)
    assert switch.rest_rates[4] == 4.0  # the estimate stands in for a measure, re-measured in time
    switch, regimes = first_stretch_off(lambda load: 4.0 if load == 4 else None, on_tokens=3.0)
    assert not switch.speculating and switch.gain == pytest.approx(0.75, rel=0.02)
    _, regimes = first_stretch_off(lambda load: None, on_tokens=6.0)
    assert rests_of(regimes)[:1] == [sw.MEASURE_STEPS // 4]  # no estimate: rested to measure


def test_decoding_alone_is_judged_against_a_reference_measured_at_the_same_context_length():
    """Each token reads the whole KV cache: at 16k tokens decoding alone is far slower than the reference timed as
    the target started (an empty cache). Speculation 1.5x faster than decoding alone at 16k must stay on, not be
    judged 0.6x of the short context's pace; back at a short context, the long context's pace is no reference."""
    clock = Clock()
    switch = Switch(clock=clock, rest_rates={1: 10.0})  # timed as the target started: 10 tok/s
    regimes = run(switch, clock, 400, on_tokens=6.0, alone_s=0.25, alone_every=10 ** 9, context=16_000)
    assert switch.rest_rates[1] == pytest.approx(4.0) and switch.rest_contexts[1] == pytest.approx(16_000)
    assert switch.established and switch.gain == pytest.approx(1.5)
    assert regimes.count(False) == sw.MEASURE_STEPS  # one measuring rest, never a rest for a lost judgement
    regimes = run(switch, clock, 400, on_tokens=12.0, alone_s=0.1, alone_every=10 ** 9, context=500)
    assert switch.rest_rates[1] == pytest.approx(10.0) and switch.gain == pytest.approx(1.2)
    assert regimes.count(False) == sw.MEASURE_STEPS


def test_a_reference_holds_within_its_context_span():
    clock = Clock()
    switch = Switch(clock=clock, rest_rates={1: 4.0}, rest_contexts={1: 16_000.0})
    regimes = run(switch, clock, 200, on_tokens=6.0, alone_s=0.25, alone_every=10 ** 9, context=18_000)
    assert all(regimes) and switch.gain == pytest.approx(1.5)  # 18k is within the span of 16k: judged at once
