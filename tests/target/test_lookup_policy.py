"""The context lookup pays or rests (duo.target.lookup_policy): its rows join a step only where their expected tokens
per second beat the step without them, a lookup whose rows delivered less than the same steps without them rests, and it
comes back on trial; resting, a step of the target alone is exactly a step alone."""

from __future__ import annotations

import asyncio
from typing import Callable

import numpy as np
import pytest

from duo.costs import StepCosts
from duo.llama.worker import ModelWorker
from duo.sampling.params import SamplingParams
from duo.target import lookup_policy as lp
from duo.target.target import Target
from duo.target.lookup_policy import GainMeter, LookupGate, LookupRecord, step_without_rows
from duo.target.policy import AdaptivePolicy, choose_together, split_rate
from duo.target.request import GenerationStats, Request, SpecSettings
from helpers.generation import generated
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.clock import rests_of

def compute_bound(n: int) -> float:
    return 0.1 * n


def memory_bound(n: int) -> float:
    return 0.1 * (1 + 0.05 * (n - 1))


def moderate(n: int) -> float:
    return 0.1 * (1 + 0.3 * (n - 1))


class Run:
    """One request's steps, simulated: a chain of `chain` drafts accepted at `chain_rate` each, then the lookup's
    `proposed` tokens accepted at `rate` each (i.i.d.), a call of n tokens taking cost(n) seconds."""

    def __init__(self, policy: AdaptivePolicy | None = None, seed: int = 0) -> None:
        self.policy = policy or AdaptivePolicy(max_draft=8)
        self.rng = np.random.default_rng(seed)
        self.ks: list[int] = []    # each step's drafts in the batch
        self.rows: list[int] = []  # each step's lookup rows
        self.seconds = 0.0

    def step(self, cost: Callable[[int], float], rate: float, *, chain: int = 0, chain_rate: float = 0.9,
             proposed: int = 8) -> int:
        policy = self.policy
        policy.free_from = policy.lookup_from = chain
        pending = chain + proposed
        k = choose_together([policy], [pending], policy.costs)[0]
        verified = min(pending, k + 1)  # the batch's last row checks one draft more
        accepted = 0
        while accepted < verified and self.rng.random() < (chain_rate if accepted < chain else rate):
            accepted += 1
        seconds = cost(k + 1)
        self.seconds += seconds
        policy.costs.observe(k + 1, seconds)
        rows = policy.observe_lookup(k + 1, accepted, k + 1, seconds)
        policy.observe_acceptance(verified, accepted)
        self.ks.append(k)
        self.rows.append(rows)
        return k

    def steps(self, n: int, cost: Callable[[int], float], rate: float, **kwargs) -> None:
        if not self.policy.costs.timed:
            self.policy.costs.observe(1, cost(1))  # the target times a step alone as it starts (Target.batcher)
        for _ in range(n):
            self.step(cost, rate, **kwargs)


def test_a_lookup_accepted_like_new_code_on_a_compute_bound_target_rests_and_steps_are_steps_alone():
    run = Run()
    run.steps(400, compute_bound, rate=0.4)
    settled = run.ks[20:]
    assert settled.count(0) == len(settled), "no lookup row after the costs were measured"
    alone = len(settled) * compute_bound(1)
    assert run.seconds - sum(compute_bound(k + 1) for k in run.ks[:20]) == pytest.approx(alone)


def test_a_lookup_that_copies_the_prompt_on_a_memory_bound_target_runs_and_delivers():
    run = Run()
    run.steps(300, memory_bound, rate=0.9)
    assert np.mean(run.ks[50:]) >= 3
    assert run.policy.lookup.running and run.policy.lookup.established
    assert run.policy.lookup.gain is not None and run.policy.lookup.gain > 1.5
    assert run.policy.lookup.reason().startswith("on (")


def test_a_rested_lookup_comes_back_when_the_text_starts_repeating():
    run = Run()
    run.steps(300, moderate, rate=0.3)  # new code: E(1) / T(2) = 1.3 / 1.3, below the margin
    # Rows only where the estimate of the first token's acceptance strays above 0.365 (E(1) / T(2) > 1.05), and then
    # for a trial that the measured gain ends.
    assert sum(rows > 0 for rows in run.rows[-200:]) <= 10
    run.steps(100, moderate, rate=0.95)  # an edit: the first token's acceptance, checked for free, rises
    assert sum(k > 0 for k in run.ks[-60:]) >= 55
    assert np.mean(run.ks[-60:]) >= 3


def pinned(run: Run, rate: float) -> None:
    """The lookup's acceptance estimate held at `rate` (learnt, say, from the grammar's forced tokens, which share
    the free drafts' positions): the cost model then expects its rows to pay whatever they deliver."""
    for average in run.policy.free.rates:
        average.value, average.weight = rate, 100.0


def test_rows_that_deliver_less_than_the_same_steps_without_them_rest_the_lookup_whatever_the_cost_model_expects():
    run = Run()
    on = []
    for _ in range(2000):
        pinned(run, 0.9)
        run.step(memory_bound, rate=0.05)
        on.append(run.policy.lookup.running)
    gate = run.policy.lookup
    assert gate.gain is not None and gate.gain < 1.0 and not gate.running
    assert gate.reason().startswith("resting (")
    rests = rests_of(on)
    # Rests double while the trials lose (each trial: TRIAL_STEPS steps with rows, then the judgement).
    assert rests == [lp.REST_STEPS * 2 ** min(i, lp.MAX_DOUBLINGS) for i in range(len(rests))] and len(rests) >= 5
    assert gate.trials == len(rests)
    assert sum(rows > 0 for rows in run.rows) == lp.TRIAL_STEPS * (gate.trials + 1)  # the first trial, then re-probes


def test_with_a_draft_chain_lookup_tokens_join_only_where_they_add_expected_gain():
    weak, strong = Run(seed=1), Run(seed=1)
    weak.steps(300, memory_bound, rate=0.2, chain=3, chain_rate=0.9)
    strong.steps(300, memory_bound, rate=0.95, chain=3, chain_rate=0.9)
    assert sum(k > 3 for k in weak.ks[50:]) == 0  # the chain alone, its last row checking the lookup's first token
    assert sum(k > 3 for k in strong.ks[50:]) >= 200


def test_lookup_rows_must_beat_the_plan_without_them_by_the_margin():
    policy = AdaptivePolicy(max_draft=8)
    costs = StepCosts()
    for n in range(1, 12):
        costs.observe(n, memory_bound(n))
    policy.costs = costs
    for average in policy.acceptance.rates:
        average.value, average.weight = 0.9, 100.0
    for rate in (0.05, 0.6):
        for average in policy.free.rates:
            average.value, average.weight = rate, 100.0
        policy.free_from = policy.lookup_from = 3
        k = choose_together([policy], [8], costs)[0]
        policy.free_from = policy.lookup_from = 3
        chain_only = split_rate([policy], [3], costs)
        best_with = max(split_rate([policy], [k], costs) for k in range(4, 9))
        assert (k > 3) == (best_with > (1 + lp.LOOKUP_MARGIN) * chain_only)
    assert k > 3  # at 0.6 the lookup pays on this curve


def test_the_target_times_a_step_alone_for_the_cost_model_as_it_starts(target_model):
    # Where the lookup proposes at every step no step decodes alone, and T(1) extrapolated down from longer calls
    # (duo.costs.StepCosts) overrates it: rows that lose would look as if they paid.
    target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings())
    asyncio.run(target.batcher())
    assert target.control.costs.measured_seconds(1) == pytest.approx(1.0 / target.control.switch.rest_rates[1])
    asyncio.run(target.close())


def test_a_step_without_its_lookup_rows_is_known_exactly():
    costs = StepCosts()
    for n in range(1, 8):
        costs.observe(n, compute_bound(n))
    # 2 chain drafts, then 3 lookup rows (batch 6); the chain's second rejected: without the rows the same 2 tokens.
    assert step_without_rows(1, 6, 2, 6, 0.6, costs) == (3, 2, pytest.approx(0.3))
    # All 5 accepted: 6 tokens with the rows, 3 without (the chain and the token after it).
    assert step_without_rows(5, 6, 2, 6, 0.6, costs)[1] == 3
    meter = GainMeter()
    meter.add(6, 0.6, 3, 0.3)
    assert meter.gain() == pytest.approx(1.0)


def test_a_new_request_starts_where_earlier_requests_left_the_lookup():
    shared = LookupRecord()
    first = LookupGate(shared)
    for _ in range(lp.TRIAL_STEPS):
        first.metered(1, 0.5, 1, 0.1, first_rate=0.3)  # rows that cost 5x for nothing
    assert not first.running and shared.resting
    second = LookupGate(shared)
    assert not second.running and second.steps_left == lp.REST_STEPS
    assert second.meter.gain() == pytest.approx(0.2)
    second.proposed_unused(first_rate=0.3 + lp.RISE)  # its own text repeats: a trial at once
    assert second.running and second.trials == 1


class ScriptedCosts(StepCosts):
    """T(n) from a curve, whatever the calls measured: the tiny model's own costs are an overhead's."""

    def __init__(self, cost: Callable[[int], float]) -> None:
        super().__init__()
        self.cost = cost
        self.observe(1, cost(1))

    def observe(self, batch_size: int, seconds: float) -> None:
        super().observe(batch_size, self.cost(batch_size))


def generate(target: Target, prompt: list[int], n: int, params: SamplingParams = SamplingParams(),
             seed: int | None = None) -> tuple[list[int], GenerationStats, list[int]]:
    """The tokens, the stats, and the lookup rows each step decoded where the lookup proposed (in order)."""
    rows, before = [], [(0, 0)]

    async def note_rows(stats: GenerationStats) -> None:
        now = (stats.lookup_tokens_decoded, stats.lookup_steps_rested)
        if now != before[0]:
            rows.append(now[0] - before[0][0])
        before[0] = now

    tokens, stats = generated(target, Request(prompt, params, seed=seed, max_tokens=n), note_rows)
    return tokens, stats, rows


def scripted_target(model, cost: Callable[[int], float]) -> Target:
    target = Target(model, ModelWorker(), None, n_ctx=1024, settings=SpecSettings())
    target.control.costs = ScriptedCosts(cost)
    return target


# The tiny model's weights are random: it copies no prompt, but greedy, its text soon loops through its few words
# (the lookup's guesses are then accepted, as in an edit), while sampled at temperature 1 it rarely repeats (as new
# code does).
NEW_CODE = ("import json\nfrom pathlib import Path\n\n\ndef load(path: Path) -> dict:\n"
            "    with path.open() as handle:\n        return json.load(handle)\n")
EDIT = ("def area(r):\n    return 3.14 * r * r\n\n" * 8) + "def area("
FIRST_STEPS = 16  # steps with proposals in which the cost model may still try batch sizes it has not timed


def test_on_a_compute_bound_target_alone_even_an_accepted_lookup_decodes_rows_only_in_its_first_steps(target_model):
    prompt = target_model.tokenize(EDIT, add_special=False)
    tokens, stats, rows = generate(scripted_target(target_model, compute_bound), prompt, 96)
    assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, tokens, 96)
    assert stats.lookup_tokens_accepted > 0  # checked by the one row each step decodes anyway
    assert sum(rows[:FIRST_STEPS]) <= 4 and sum(rows[FIRST_STEPS:]) == 0 and len(rows) > 40
    assert sum(stats.batch_sizes[2:]) == sum(n > 0 for n in rows)  # every other step decoded its one token alone


def test_the_target_alone_rests_a_lookup_on_text_that_does_not_repeat_and_keeps_one_on_text_that_does(target_model):
    new_code = target_model.tokenize(NEW_CODE, add_special=False)
    _, stats, rows = generate(scripted_target(target_model, moderate), new_code, 128, SamplingParams(temperature=1.0),
                              seed=3)
    assert sum(rows[FIRST_STEPS:]) <= 3 and len(rows) >= 2 * FIRST_STEPS
    edit = target_model.tokenize(EDIT, add_special=False)
    _, stats, rows = generate(scripted_target(target_model, moderate), edit, 128)
    assert sum(rows[FIRST_STEPS:]) >= 30
    assert stats.lookup_tokens_accepted >= 0.6 * stats.lookup_tokens_verified
    assert stats.lookup.startswith("on")
