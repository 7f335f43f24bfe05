"""The draft's value model: what a round is worth, and what commits teach it about its own guesses."""

from __future__ import annotations

import numpy as np
import pytest

from duo.branches import Branch, Doubt
from duo.draft_session import DraftSession, Slot
from duo.draft_value import (MIN_VALUE, PRIOR_ACCEPTANCE, PRIOR_ALTERNATIVE, Calibration, Horizon, best_round,
                             confidence)
from duo.sampling import SamplingParams

OPEN = Horizon(chain_open=True, fork_limit=100, branch_cap=4, new_branches=4)


def test_a_round_is_worth_the_chance_that_its_token_is_committed():
    calibration = Calibration()  # no commit yet: every position accepted at the prior
    a = PRIOR_ACCEPTANCE
    lead = best_round(committed=10, chain_len=13, doubts={}, branches=[], horizon=OPEN, calibration=calibration)
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
