"""The draft's value model: what a round is worth, and what commits teach it about its own guesses."""

from __future__ import annotations

import numpy as np
import pytest

from duo.costs import PRIOR_BATCH_SLOPE
from duo.draft.branches import Branch, Doubt
from duo.draft.session import DraftSession, Slot
from duo.draft.value import (MAX_TIMED_TOKENS, MIN_VALUE, PRIOR_ACCEPTANCE, PRIOR_ALTERNATIVE,
                             Calibration, Horizon, Round, RoundCost, confidence, ranked_rounds, with_riders)
from duo.sampling.params import SamplingParams
from helpers.drafting import FixedExtraCost

OPEN = Horizon(chain_open=True, fork_limit=100, branch_cap=4, new_branches=4)


def best_round(*situation) -> Round | None:
    """The round worth most, the one a decode holds for the session whatever the cost of a second."""
    offered = ranked_rounds(*situation)
    return offered[0] if offered else None


def test_a_round_is_worth_the_chance_that_its_token_is_committed():
    calibration = Calibration()  # no commit yet: every position accepted at the prior
    a = PRIOR_ACCEPTANCE
    lead = best_round(10, 13, {}, [], OPEN, calibration)
    assert lead.fork is None and lead.value == pytest.approx(a ** 4)  # 3 drafts before it, then its own
    fork = best_round(10, 13, {10: Doubt(-3.0, 5, None)}, [], OPEN, calibration)
    doubtful = calibration.acceptance_at(Doubt(-3.0, 5, None))
    assert fork.fork == 10 and fork.value == pytest.approx((1 - doubtful) * PRIOR_ALTERNATIVE * a)


def test_a_growing_branch_is_worth_less_with_each_of_its_drafts():
    calibration = Calibration()
    closed = Horizon(chain_open=False, fork_limit=100, branch_cap=4, new_branches=0)
    branch = Branch(epoch=2, fork=11, tokens=[5], doubts=[None])
    values = []
    for _ in range(4):
        values.append(best_round(10, 14, {}, [branch], closed, calibration))
        branch.tokens.append(1)
        branch.doubts.append(None)
    assert all(v.growing is branch for v in values)
    assert [v.value for v in values] == pytest.approx([values[0].value * PRIOR_ACCEPTANCE ** i for i in range(4)])
    assert best_round(10, 14, {}, [branch], closed, calibration) is None  # branch_cap drafts: done


def test_the_chain_runs_to_the_horizon_but_no_branch_worth_less_than_a_fiftieth_of_a_token_is_drafted():
    calibration = Calibration()
    sure = {10 + i: Doubt(6.0, 5, None) for i in range(12)}
    lead = best_round(10, 22, {}, [], OPEN, calibration)
    assert lead.fork is None and lead.value < MIN_VALUE  # a lead of 12 at 0.7 each: still drafted
    closed = Horizon(chain_open=False, fork_limit=100, branch_cap=4, new_branches=4)
    assert best_round(10, 22, sure, [], closed, calibration) is None  # a rejection at a sure position: < 2%
    doubtful = {**sure, 12: Doubt(-1.0, 5, None)}
    assert best_round(10, 22, doubtful, [], closed, calibration).fork == 12


def test_calibration_scales_confidence_to_the_measured_acceptance():
    calibration = Calibration()
    sure, unsure = Doubt(4.0, 1, None), Doubt(0.0, 1, None)
    for _ in range(60):  # confident drafts that the target rejects half the time
        calibration.judge(sure, accepted=True, committed_token=0)
        calibration.judge(sure, accepted=False, committed_token=1)
    assert calibration.acceptance.value == pytest.approx(0.5, abs=0.05)
    assert calibration.alternative.value > 0.9  # every rejection committed the alternative
    assert calibration.acceptance_at(sure) == pytest.approx(0.5, abs=0.05)
    assert calibration.acceptance_at(unsure) == pytest.approx(0.5 * confidence(unsure) / confidence(sure), abs=0.05)


def test_commits_judge_the_drafts_they_decide_and_no_others():
    session = DraftSession(session_id=1, chain=[7, 8, 4, 5, 6, 1], committed=2, params=SamplingParams(),
                           rng=np.random.default_rng(0), max_ahead=8, p_min=0.0, slot=Slot(0, 1), n_ctx=256,
                           max_branches=2)
    session.doubts = {2: Doubt(1.0, 9, None), 3: Doubt(1.0, 9, None), 4: Doubt(1.0, 3, None)}
    session.apply_commit(2, [4, 5])  # two drafts kept
    kept = session.calibration.acceptance.value
    assert kept > PRIOR_ACCEPTANCE and session.calibration.alternative.value == PRIOR_ALTERNATIVE
    session.apply_commit(4, [3, 2])  # the draft at 4 rejected for its alternative; 5 and beyond undecided
    assert session.calibration.acceptance.value < kept and session.calibration.alternative.value > PRIOR_ALTERNATIVE
    assert session.calibration.acceptance.weight == pytest.approx((1 * 0.95 + 1) * 0.95 ** 2 + 0.95 + 1)


def test_the_other_kind_of_round_rides_along_when_worth_what_it_adds_to_the_decode():
    calibration = Calibration()
    doubts = {10: Doubt(-0.5, 5, None)}  # a doubtful first draft: its branch is worth more than the lead
    doubtful = calibration.acceptance_at(doubts[10])
    lead_value = doubtful * PRIOR_ACCEPTANCE ** 3
    fork_value = (1 - doubtful) * PRIOR_ALTERNATIVE * PRIOR_ACCEPTANCE
    offered = ranked_rounds(10, 13, doubts, [], OPEN, calibration)
    assert [(r.fork, r.value) for r in offered] == [(10, pytest.approx(fork_value)), (None, pytest.approx(lead_value))]
    assert with_riders([offered], FixedExtraCost(0.2)) == [offered]
    dear = lead_value / fork_value + 0.01  # one more token costs more than the lead is worth beside the branch
    assert with_riders([offered], FixedExtraCost(dear)) == [offered[:1]]
    closed = Horizon(chain_open=False, fork_limit=100, branch_cap=4, new_branches=4)
    assert [r.fork for r in ranked_rounds(10, 13, doubts, [], closed, calibration)] == [10]
    sure = {10: Doubt(6.0, 5, None)}  # no branch worth MIN_VALUE is offered, however cheap a token
    assert [r.fork for r in ranked_rounds(10, 13, sure, [], OPEN, calibration)] == [None]


def test_a_rider_pays_for_the_time_it_adds_to_every_sessions_tokens_in_the_decode():
    lead, branch = Round(0.5), Round(0.2, fork=3)
    alone = with_riders([[lead, branch]], FixedExtraCost(0.3))  # 0.2 >= 0.3 * 0.5: worth it beside one lead
    assert alone == [[lead, branch]]
    others = [[Round(0.5)] for _ in range(3)]  # three more sessions' leads delayed too: 0.2 < 0.3 * 2.0
    assert with_riders([[lead, branch], *others], FixedExtraCost(0.3)) == [[lead], *others]
    better = Round(0.7, fork=5)  # riders worth most first; the first that does not pay ends them
    chosen = with_riders([[lead, branch], [Round(0.9), better]], FixedExtraCost(0.45))
    assert chosen == [[lead], [Round(0.9), better]]  # 0.7 >= 0.45 * 1.4, then 0.2 < 0.45 * 2.1


def test_round_cost_is_what_one_more_token_adds_to_a_round_as_measured():
    cost = RoundCost()
    assert cost.extra(1) == pytest.approx(PRIOR_BATCH_SLOPE)  # nothing timed yet: optimistic, so it is tried
    for _ in range(5):
        cost.observe(1, 0.066)
        cost.observe(2, 0.080)
        cost.observe(4, 0.079)  # noise: a longer round never counts as cheaper
        cost.observe(MAX_TIMED_TOKENS + 1, 9.0)  # a prompt's catch-up, not a drafting round
    assert cost.extra(1) == pytest.approx(0.080 / 0.066 - 1)
    assert cost.extra(2) == 0.0 and cost.extra(3) == 0.0  # 3 interpolated between 2 and 4
    assert cost.extra(4) == pytest.approx(PRIOR_BATCH_SLOPE)  # beyond the sizes timed: optimistic again
    assert cost.costs.measured_seconds(MAX_TIMED_TOKENS + 1) is None
