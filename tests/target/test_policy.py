"""The adaptive policy picks the draft length that maximises expected tokens per second."""

import itertools

import numpy as np

import pytest

from duo.costs import PRIOR_BATCH_SLOPE, StepCosts
from duo.target.policy import EXPLORE_EVERY, PROBE_LEAD, Acceptance, AdaptivePolicy, DraftTiming, allocate


def teach(policy: AdaptivePolicy, cost, acceptance: float, steps: int = 200) -> None:
    """Feed the policy steps of every batch size with cost(n) seconds and i.i.d. acceptance."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        for k in range(policy.max_draft + 1):
            accepted = 0
            while accepted < k and rng.random() < acceptance:
                accepted += 1
            policy.observe(batch_size=k + 1, n_verified=k, n_accepted=accepted, seconds=cost(k + 1))


def test_a_memory_bound_target_speculates_deeply():
    policy = AdaptivePolicy(max_draft=8)
    teach(policy, cost=lambda n: 0.1 * (1 + 0.1 * (n - 1)), acceptance=0.8)
    assert policy.choose(8) >= 4


def test_a_compute_bound_target_decodes_alone():
    policy = AdaptivePolicy(max_draft=8)
    teach(policy, cost=lambda n: 0.1 * n, acceptance=0.8)
    assert policy.choose(8) == 0


def test_poor_acceptance_switches_speculation_off_even_when_verifying_is_cheap():
    policy = AdaptivePolicy(max_draft=8)
    teach(policy, cost=lambda n: 0.1 * (1 + 0.3 * (n - 1)), acceptance=0.1)
    assert policy.choose(8) == 0


def test_the_choice_never_exceeds_the_pending_drafts():
    policy = AdaptivePolicy(max_draft=8)
    teach(policy, cost=lambda n: 0.1, acceptance=0.95)
    assert policy.choose(3) == 3
    assert policy.choose(0) == 0


def test_with_no_measurements_speculation_is_tried():
    assert AdaptivePolicy(max_draft=8).choose(4) > 0


def test_the_policy_explores_one_longer_draft_now_and_then():
    policy = AdaptivePolicy(max_draft=8)
    teach(policy, cost=lambda n: 0.1 * n, acceptance=0.8)
    choices = [policy.choose(8) for _ in range(2 * EXPLORE_EVERY)]
    assert choices.count(1) == 2 and choices.count(0) == 2 * EXPLORE_EVERY - 2


def test_unmeasured_batch_sizes_are_interpolated_and_larger_ones_assumed_cheap_until_tried():
    policy = AdaptivePolicy(max_draft=8)
    policy.observe(batch_size=1, n_verified=0, n_accepted=0, seconds=1.0)
    policy.observe(batch_size=3, n_verified=2, n_accepted=2, seconds=2.0)
    assert policy.costs.batch_seconds(2) == 1.5
    assert policy.costs.batch_seconds(5) == pytest.approx(2.0 * (1 + 2 * PRIOR_BATCH_SLOPE))


def test_a_costly_first_extra_token_does_not_stop_the_policy_from_trying_longer_drafts():
    """On a CPU, T(2) can be far above T(1) while T(5) is barely above T(2) (a kernel switch)."""
    costs = {1: 0.100, 2: 0.175, 3: 0.185, 4: 0.200, 5: 0.215, 6: 0.230, 7: 0.245, 8: 0.26, 9: 0.275}
    policy = AdaptivePolicy(max_draft=8)
    rng = np.random.default_rng(0)
    for _ in range(100):
        k = policy.choose(8)
        accepted = 0
        while accepted < k and rng.random() < 0.85:
            accepted += 1
        policy.observe(batch_size=k + 1, n_verified=k, n_accepted=accepted, seconds=costs[k + 1])
    assert policy.choose(8) >= 4


def test_the_draft_is_steered_to_stay_ahead_of_the_choice():
    policy = AdaptivePolicy(max_draft=8)
    teach(policy, cost=lambda n: 0.1 * (1 + 0.05 * (n - 1)), acceptance=0.9)
    k = policy.choose(8)
    assert policy.max_ahead() > k


def test_the_draft_rests_when_speculation_does_not_pay_but_for_probes_before_explorations():
    policy = AdaptivePolicy(max_draft=8)
    teach(policy, cost=lambda n: 0.1 * n, acceptance=0.8)
    leads, choices = [], []
    for _ in range(4 * EXPLORE_EVERY):
        choices.append(policy.choose(2))
        leads.append(policy.max_ahead())
    assert leads.count(0) == 4 * (EXPLORE_EVERY - PROBE_LEAD)
    # Every exploration (a choice of 1) comes right after a probe let the draft run.
    for i, k in enumerate(choices):
        if k == 1:
            assert leads[i - 1] > 0


def test_an_exploration_that_found_no_drafts_waits_for_the_next_step_that_has_some():
    policy = AdaptivePolicy(max_draft=8)
    teach(policy, cost=lambda n: 0.1 * n, acceptance=0.8)
    for _ in range(EXPLORE_EVERY):
        policy.choose(0)  # the draft was resting: nothing pending when the exploration came due
    assert policy.max_ahead() > 0, "the draft must keep running until the exploration happened"
    assert policy.choose(2) == 1
    assert policy.max_ahead() == 0


def test_requests_share_step_costs_but_learn_their_own_acceptance():
    costs, greedy = StepCosts(), Acceptance.prior(8)
    code = AdaptivePolicy(max_draft=8, costs=costs, shared=greedy)
    prose = AdaptivePolicy(max_draft=8, costs=costs, shared=greedy)
    for _ in range(100):
        code.observe(batch_size=5, n_verified=4, n_accepted=4, seconds=0.12)
        prose.observe(batch_size=5, n_verified=4, n_accepted=0, seconds=0.12)
    assert code.costs.batch_seconds(5) == prose.costs.batch_seconds(5) == pytest.approx(0.12)
    assert code.acceptance.rates[0].value > 0.95 and prose.acceptance.rates[0].value < 0.05


def test_a_new_request_starts_from_its_modes_estimate_but_soon_follows_its_own():
    greedy = Acceptance.prior(8)
    first = AdaptivePolicy(max_draft=8, shared=greedy)
    for _ in range(200):
        first.observe(batch_size=3, n_verified=2, n_accepted=0, seconds=0.1)
    second = AdaptivePolicy(max_draft=8, shared=greedy)
    assert second.acceptance.rates[0].value < 0.1  # it learnt from the first request
    for _ in range(20):
        second.observe(batch_size=3, n_verified=2, n_accepted=2, seconds=0.1)
    assert second.acceptance.rates[0].value > 0.6  # the prior weighs only PRIOR_WEIGHT observations


def timing(latency: float, per_token: float) -> DraftTiming:
    measured = DraftTiming()
    measured.latency.add(latency)
    measured.per_token.add(per_token)
    return measured


def test_a_slow_memory_bound_target_waits_for_drafts_from_a_much_faster_draft():
    policy = AdaptivePolicy(max_draft=8)
    teach(policy, cost=lambda n: 0.140 * (1 + 0.04 * (n - 1)), acceptance=0.8)
    k, wait = policy.wait_for(timing(latency=0.010, per_token=0.005), since_commit=0.0)
    assert k >= 4 and wait == pytest.approx(0.010 + 0.005 * (k - 1))
    later_k, later_wait = policy.wait_for(timing(latency=0.010, per_token=0.005), since_commit=0.008)
    assert later_wait == pytest.approx(0.002 + 0.005 * (later_k - 1))


def test_a_fast_target_or_a_draft_only_a_few_times_faster_does_not_wait():
    fast_target = AdaptivePolicy(max_draft=8)
    teach(fast_target, cost=lambda n: 0.010 * n, acceptance=0.8)
    assert fast_target.wait_for(timing(latency=0.035, per_token=0.035), since_commit=0.0) == (0, 0.0)
    # A draft 4x faster than the target: a step alone loses nothing, its drafts arrive meanwhile.
    near = AdaptivePolicy(max_draft=8)
    teach(near, cost=lambda n: 0.140 * (1 + 0.04 * (n - 1)), acceptance=0.8)
    assert near.wait_for(timing(latency=0.035, per_token=0.035), since_commit=0.0) == (0, 0.0)
    slow_draft = AdaptivePolicy(max_draft=8)
    teach(slow_draft, cost=lambda n: 0.140 * (1 + 0.04 * (n - 1)), acceptance=0.8)
    assert slow_draft.wait_for(timing(latency=0.5, per_token=0.3), since_commit=0.0) == (0, 0.0)


def test_nothing_waits_before_the_draft_was_timed():
    policy = AdaptivePolicy(max_draft=8)
    teach(policy, cost=lambda n: 0.140, acceptance=0.9)
    assert policy.wait_for(DraftTiming(), since_commit=0.0) == (0, 0.0)


def policy_accepting(rate: float, max_draft: int = 8) -> AdaptivePolicy:
    policy = AdaptivePolicy(max_draft=max_draft)
    for average in policy.acceptance.rates:
        average.value, average.weight = rate, 100.0
    return policy


def flat_costs(slope: float) -> StepCosts:
    costs = StepCosts()
    for n in range(1, 80):
        costs.observe(n, 1.0 + slope * (n - 1))
    return costs


@pytest.mark.parametrize("rates,slope", [((0.9, 0.5), 0.1), ((0.8, 0.8, 0.3), 0.05), ((0.6,), 0.2), ((0.95, 0.2), 0.5)])
def test_requests_in_one_call_get_the_draft_lengths_that_commit_the_most_tokens_per_second(rates, slope):
    policies = [policy_accepting(rate, max_draft=5) for rate in rates]
    costs = flat_costs(slope)
    chosen = allocate(policies, [5] * len(policies), costs)

    def rate(ks: tuple[int, ...]) -> float:
        tokens = sum(policy.expected_tokens(k) for policy, k in zip(policies, ks))
        return tokens / costs.batch_seconds(sum(k + 1 for k in ks))

    best = max(itertools.product(range(6), repeat=len(policies)), key=rate)
    assert rate(tuple(chosen)) == pytest.approx(rate(best))


def test_one_request_alone_gets_the_single_request_choice_and_a_likelier_request_gets_more_drafts():
    costs = flat_costs(0.1)
    sure, unsure = policy_accepting(0.9), policy_accepting(0.4)
    sure.costs = unsure.costs = costs
    assert allocate([sure], [8], costs) == [max(range(9), key=lambda k: sure.expected_tokens(k) / costs.batch_seconds(k + 1))]
    k_sure, k_unsure = allocate([sure, unsure], [8, 8], costs)
    assert k_sure > k_unsure
    # A call already carrying many tokens (other requests, a prompt chunk) makes drafts cheaper per token.
    assert sum(allocate([sure, unsure], [8, 8], costs, other_tokens=0)) <= sum(allocate([sure, unsure], [8, 8], costs,
                                                                                         other_tokens=60))
