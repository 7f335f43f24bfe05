"""duo.target.control: speculation control's verbs, plan() before a step and observe() after it, with no model."""

from __future__ import annotations

import pytest

from duo.costs import DECAY
from duo.sampling.params import SamplingParams
from duo.sampling.verification import Verdict
from duo.target.batching import VerifyResult
from duo.target.control import SpeculationControl
from duo.target.generation import Generation
from duo.target.request import Request, SpecSettings, StepRecord
from helpers.fake_drafts import RecordingDraft


def added(control: SpeculationControl, session_id: int = 1, seed: int | None = None) -> Generation:
    """A request added to `control`: greedy, or sampled at temperature 1 with `seed` (coupled verification)."""
    params = SamplingParams() if seed is None else SamplingParams(temperature=1.0)
    generation = Generation(session_id, Request([1, 2, 3], params, seed=seed), None, control.settings)
    control.add(generation)
    return generation


def rejected_step(n_verified: int) -> tuple[VerifyResult, StepRecord]:
    """A step whose first draft was rejected: one token (the recovered one) committed."""
    result = VerifyResult(Verdict(0, [7]), n_verified, n_verified + 1, 0.01, call_tokens=n_verified + 1)
    return result, StepRecord(batch_size=n_verified + 1, n_verified=n_verified, n_accepted=0, n_committed=1,
                              seconds=0.01)


def test_a_step_verifies_the_drafts_chain_only_while_the_switch_judging_it_speculates():
    control = SpeculationControl(SpecSettings())
    generation = added(control)
    assert generation.switch is control.switch and generation.policy.switch is control.switch
    assert control.plan(generation).chain and control.plan(generation).policy is generation.policy
    control.switch.speculating = False  # the switch rests the draft: its chain waits, free drafts may still pay
    assert not control.plan(generation).chain


def test_a_request_not_adaptive_has_no_policy_and_verifies_whatever_its_draft_sent():
    control = SpeculationControl(SpecSettings(adaptive=False))
    generation = added(control)
    control.switch.speculating = False
    plan = control.plan(generation)
    assert plan.policy is None and plan.chain


def test_what_a_step_measured_teaches_the_next_request_of_its_verification_mode_and_no_other():
    control = SpeculationControl(SpecSettings())
    first = added(control)
    prior = first.policy.acceptance.rates[0].value
    control.observe(first, *rejected_step(4))
    assert added(control, 2).policy.acceptance.rates[0].value < prior  # greedy, as the first
    assert added(control, 3, seed=5).policy.acceptance.rates[0].value == prior  # sampled: learnt apart
    assert first.stats.speculation == control.switch.reason()
    assert control.draft_len == first.policy.draft_len


def test_a_step_with_a_draft_counts_towards_its_switch_and_its_acceptance_towards_placement():
    control = SpeculationControl(SpecSettings(), drafts=True)
    control.pool.add(RecordingDraft("a"))
    generation = added(control)
    control.pool.register(generation)
    switch = control.pool.members[0].switch
    assert generation.switch is switch and control.serves(generation)
    generation.split = (4, 0, 0)  # four of the draft's own tokens led the batch
    control.observe(generation, *rejected_step(4))
    control.observe(generation, *rejected_step(4))
    assert switch.requests == 1 and control.switch.requests == 0  # the draft's switch counts it, not the target's
    acceptance = control.pool.members[0].view.acceptance  # each step judged its first draft: rejected
    assert acceptance.value == 0.0 and acceptance.weight == pytest.approx(1 + DECAY)
    control.finish(generation)
    assert switch.requests == 0
