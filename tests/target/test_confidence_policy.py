"""A step's drafts judged by the draft's own confidence: the chain keeps each draft's confidence, a calibration
learns how often drafts at each confidence are accepted, and the policy verifies the drafts it says will pass."""

import pytest

from duo.target.chain import DraftChain
from duo.target.confidence import CONFIDENCE_EDGES, Calibration
from duo.target.policy import AdaptivePolicy

MEMORY_BOUND = [0.1 * (1 + 0.1 * (n - 1)) for n in range(1, 18)]  # T(n): verifying more drafts costs little


def policy_with(calibration: Calibration) -> AdaptivePolicy:
    policy = AdaptivePolicy(max_draft=8, calibration=calibration)
    for n, seconds in enumerate(MEMORY_BOUND, start=1):
        policy.costs.observe(n, seconds)
    return policy


def calibration_where(accepted: dict[float, bool], steps: int = 100) -> Calibration:
    """A calibration taught that drafts at each confidence c are always accepted, or never (one draft per step)."""
    calibration = Calibration.prior()
    for confidence, passes in accepted.items():
        for _ in range(steps):
            calibration.observe([confidence], int(passes))
    return calibration


# --- the chain keeps each draft's confidence beside it ---------------------------------------------------------


def test_the_chain_keeps_each_pending_drafts_confidence_and_drops_those_committed():
    committed = [7, 8]
    chain = DraftChain(committed)
    chain.receive(0, 2, [1, 2], [], confidences=[0.9, 0.5])
    chain.receive(0, 4, [3], [], confidences=[0.25])
    assert chain.pending_confidences() == [0.9, 0.5, 0.25]
    committed.extend([1, 2])
    chain.on_commit()
    assert chain.pending()[0] == [3] and chain.pending_confidences() == [0.25]


def test_a_branch_that_takes_over_brings_its_own_confidences_without_its_assumed_tokens():
    committed = [7, 8]
    chain = DraftChain(committed)
    chain.receive(0, 2, [1, 2, 3], [], confidences=[0.9, 0.6, 0.8])
    chain.receive(1, 3, [4, 5, 6], [], branch_of=0, confidences=[0.0, 0.7, 0.95])  # assumes 4 instead of 2
    committed.extend([1, 4])  # the target rejected 2 and committed the branch's assumed token
    chain.on_commit()
    assert chain.pending()[0] == [5, 6] and chain.pending_confidences() == [0.7, 0.95]


def test_a_draft_that_sends_no_confidences_leaves_none_beside_its_drafts():
    chain = DraftChain([7, 8])
    chain.receive(0, 2, [1, 2], [])
    chain.receive(0, 4, [3], [], confidences=[0.5])
    assert chain.pending_confidences() == [None, None, 0.5]


# --- the calibration ---------------------------------------------------------------------------------------


def test_a_bin_knows_nothing_until_it_sees_a_draft_then_learns_from_its_prior_at_the_bins_midpoint():
    calibration = Calibration.prior()
    assert calibration.rate(0.4) is None
    calibration.observe([0.4], 0)
    assert 0 < calibration.rate(0.4) < (0.3 + 0.5) / 2  # moved from the mid-point towards the rejection
    assert calibration.rate(0.95) is None  # other bins untouched


def test_the_calibration_learns_acceptance_by_confidence():
    calibration = Calibration.prior()
    for step in range(400):  # drafts at 0.99 accepted 19 times in 20, drafts at 0.4 once in 10
        calibration.observe([0.99], int(step % 20 != 0))
        calibration.observe([0.4], int(step % 10 == 0))
    assert calibration.rate(0.995) == pytest.approx(0.95, abs=0.06)
    assert calibration.rate(0.35) == pytest.approx(0.1, abs=0.1)


def test_drafts_past_the_first_rejection_teach_the_calibration_nothing():
    calibration = Calibration.prior()
    calibration.observe([0.99, 0.6, 0.4, 0.2], 1)  # 0.99 accepted, 0.6 rejected: 0.4 and 0.2 were never judged
    assert calibration.rate(0.99) > CONFIDENCE_EDGES[-2] and calibration.rate(0.6) < 0.6
    assert calibration.rate(0.4) is None and calibration.rate(0.2) is None


def test_a_confidence_of_exactly_one_falls_in_the_last_bin():
    assert Calibration.bin_of(1.0) == Calibration.bin_of(0.995) == len(CONFIDENCE_EDGES) - 2
    assert Calibration.bin_of(0.0) == 0


# --- the policy ------------------------------------------------------------------------------------------------


def test_the_policy_stops_before_a_draft_whose_confidence_calibration_says_fails():
    policy = policy_with(calibration_where({0.99: True, 0.4: False}))
    policy.judge_pending([0.99, 0.99, 0.4, 0.99, 0.99, 0.99])
    assert policy.choose(6) == 2


def test_the_policy_verifies_more_drafts_where_the_draft_is_confident():
    calibration = calibration_where({0.99: True, 0.4: False})
    confident, unsure = policy_with(calibration), policy_with(calibration)
    confident.judge_pending([0.99] * 8)
    unsure.judge_pending([0.4] * 8)
    assert unsure.choose(8) == 0 and confident.choose(8) >= 6


def test_drafts_without_confidence_or_in_an_unseen_bin_keep_the_positional_rates():
    positional = policy_with(Calibration.prior())
    expected = positional.choose(6)
    old_draft = policy_with(calibration_where({0.4: False}))
    old_draft.judge_pending([None] * 6)  # a draft that sends no confidences still speculates as before
    unseen = policy_with(calibration_where({0.4: False}))
    unseen.judge_pending([0.99] * 6)
    assert expected > 0 and old_draft.choose(6) == expected and unseen.choose(6) == expected


def test_a_step_teaches_the_shared_calibration_its_chain_drafts_and_ends_their_confidences():
    calibration = Calibration.prior()
    first, second = policy_with(calibration), policy_with(calibration)
    first.judge_pending([0.99, 0.4, 0.2])
    first.free_from = 2  # the lookup's drafts from position 2: not the model's, not calibrated
    first.observe_acceptance(n_verified=3, n_accepted=3)
    assert calibration.rate(0.99) is not None and calibration.rate(0.4) is not None
    assert calibration.rate(0.2) is None
    assert first.confidences == [] and first.calibrated == []
    second.judge_pending([0.4])
    assert second.rate(0) == calibration.rate(0.4)  # another request of the mode judges by it from its first step


def test_the_lead_is_planned_with_positional_rates_whatever_this_steps_confidences():
    calibration = calibration_where({0.4: False})
    judged, unjudged = policy_with(calibration), policy_with(calibration)
    judged.judge_pending([0.4] * 8)
    assert judged.choose(8) == 0 and unjudged.choose(8) > 0
    assert judged.max_ahead() == unjudged.max_ahead() > 2  # the next drafts' confidences are not known yet
