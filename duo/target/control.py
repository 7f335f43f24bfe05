"""Speculation control on the target: plan() says what a step verifies, observe() learns from what it measured."""

from __future__ import annotations

from dataclasses import dataclass, field

from duo.costs import StepCosts
from duo.sampling.verification import COUPLED, GREEDY, RESIDUAL
from duo.target.batching import VerifyResult
from duo.target.confidence import Calibration
from duo.target.generation import Generation
from duo.target.lookup_policy import LookupRecord
from duo.target.policy import Acceptance, AdaptivePolicy, DraftTiming, StepPlan
from duo.target.pool.pool import DraftPool
from duo.target.request import SpecSettings, StepRecord
from duo.target.switch import Switch


@dataclass
class ModeRecord:
    """What the requests of one verification mode learnt, a new request's starting point: they accept differently
    (greedy, coupled, residual), so each mode keeps its own."""

    acceptance: Acceptance  # the draft's chain, by position
    free: Acceptance        # the free drafts (the lookup's, the grammar's forced text), by position
    lookup: LookupRecord = field(default_factory=LookupRecord)  # whether the lookup's rows pay
    confidence: Calibration = field(default_factory=Calibration.prior)  # the chain's acceptance by draft confidence

    @classmethod
    def prior(cls, draft_max: int) -> ModeRecord:
        return cls(Acceptance.prior(draft_max), Acceptance.prior(draft_max))


class SpeculationControl:
    """Everything that decides how the target speculates, as vLLM's Scheduler has schedule() and
    update_from_output(): add() and finish() a request, plan() a step of it, observe() what the step did.

    It holds the cost model T(n) (duo.costs, one model on one machine: shared by all requests, measured per call by
    its tokens), what each verification mode learnt (ModeRecord), the target's own switch (duo.target.switch: for
    the requests no draft serves, and the reference of decoding alone) and the pool of drafts, each judged by a
    switch of its own (duo.target.pool). Each request's adaptive policy (duo.target.policy) is made here from those;
    the batched call picks every request's draft length together with it (duo.target.batching)."""

    def __init__(self, settings: SpecSettings, drafts: bool = False) -> None:
        self.settings = settings
        self.costs = StepCosts()
        self.by_mode = {mode: ModeRecord.prior(settings.draft_max) for mode in (GREEDY, COUPLED, RESIDUAL)}
        self.switch = Switch()
        self.draft_timing = DraftTiming()  # one draft serves every request
        self.draft_len = settings.draft_max  # the latest request's preferred draft length (metrics)
        self.pool = (DraftPool(self._draft_switch, self._draft_demand, step_seconds=self._step_seconds)
                     if drafts else None)

    def observe_alone(self, seconds: float) -> None:
        """A one-token call as the target starts took `seconds`, timed before the draft works: the switch's first
        reference (the first request needs no rest), and T(1) for the cost model: where the lookup proposes at
        every step no step may decode alone to time it, and one extrapolated from longer calls' times is far too
        high (the lookup then never rests)."""
        self.switch.rest_rates.setdefault(1, 1.0 / seconds)
        self.costs.observe(1, seconds)
        self.switch.estimate_alone = self._estimate_alone

    def add(self, generation: Generation) -> None:
        """A new request: the target's own switch judges it until a draft takes it; adaptive, its policy starts
        from what the requests of its verification mode learnt, and feeds back into it."""
        generation.switch = self.switch
        if self.settings.adaptive:
            learnt = self.by_mode[generation.verification]
            generation.policy = AdaptivePolicy(self.settings.draft_max, self.costs, learnt.acceptance,
                                               generation.switch, learnt.free, shared_lookup=learnt.lookup,
                                               calibration=learnt.confidence)

    def finish(self, generation: Generation) -> None:
        """The request ended: its switch counts it no more."""
        generation.switch.request_done(generation.session_id)

    def plan(self, generation: Generation) -> StepPlan:
        """What the request's next step verifies: the draft's chain unless its switch rests the draft."""
        policy = generation.policy
        return StepPlan(policy, chain=policy is None or policy.switch.speculating)

    def observe(self, generation: Generation, result: VerifyResult, record: StepRecord) -> None:
        """Learn from a step of `generation`: its policy the lookup's rows and the drafts' acceptance, its switch
        what the step delivered, placement its draft's acceptance. (The batcher recorded the call's cost.)"""
        policy = generation.policy
        if policy is not None:
            rows = policy.observe_lookup(result.batch_size, result.verdict.n_accepted, result.call_tokens,
                                         result.seconds)
            generation.stats.count_lookup(rows, policy.lookup.trials, policy.lookup.reason())
            policy.observe_acceptance(record.n_verified, record.n_accepted)
            self._judge(generation, result, record)
            self.draft_len = policy.draft_len
        if self.pool is not None:  # the draft's own tokens lead the batch: its acceptance, for placement
            drafted = min(generation.split[0], record.n_verified)
            self.pool.observe_step(generation.session_id, drafted, min(record.n_accepted, drafted))

    def _judge(self, generation: Generation, result: VerifyResult, record: StepRecord) -> None:
        """Count the step towards its switch's judgement of speculation."""
        switch = generation.switch
        if self.serves(generation):
            switch.step_done(generation.session_id, record.n_committed, record.n_verified,
                             prefill=result.with_prefill, context=len(generation.committed))
        else:  # without a draft there is nothing to switch; the next step starts timing afresh
            switch.request_done(generation.session_id)
        generation.stats.speculation = switch.reason()

    def serves(self, generation: Generation) -> bool:
        """Whether a draft that is up serves the request now."""
        return self.pool is not None and self.pool.serves(generation.session_id)

    def any_speculating(self) -> bool:
        """Whether any switch has speculation on (the metrics' spec_decode_on)."""
        return any(switch.speculating for switch in self._switches())

    def best_gain(self) -> float | None:
        """The highest gain over decoding alone a switch last judged (None: none judged yet)."""
        gains = [switch.gain for switch in self._switches() if switch.gain is not None]
        return max(gains) if gains else None

    def _draft_switch(self) -> Switch:
        """A draft's switch: it judges its own requests' steps against the target's decoding alone (one reference,
        shared with the contexts it was measured at) at the target's load."""
        return Switch(rest_rates=self.switch.rest_rates, rest_contexts=self.switch.rest_contexts,
                      estimate_alone=self._estimate_alone, load=self._stepping)

    def _switches(self) -> list[Switch]:
        return [self.switch, *(self.pool.switches() if self.pool else [])]

    def _stepping(self) -> int:
        return sum(switch.requests for switch in self._switches())

    def _draft_demand(self) -> float:
        """Drafts a second one session can use at the current load: draft_max of them a verify step, a step of
        every running session in one call (inf before any call was timed)."""
        step = self._step_seconds()
        return max(1, self.settings.draft_max) / step if step else float("inf")

    def _step_seconds(self) -> float:
        """How long a step of every running session takes now, with draft_max drafts each (0 before any call was
        timed)."""
        load, k = max(1, self._stepping()), max(1, self.settings.draft_max)
        return self.costs.batch_seconds(load * (k + 1)) if self.costs.timed else 0.0

    def _estimate_alone(self, load: int) -> float | None:
        """Tokens per second a request decodes alone at `load` requests, from the calls timed so far: one token
        each, `load` tokens a call (a call's cost follows its tokens: S(m) = T(m) within a few % on a CPU)."""
        return 1.0 / self.costs.batch_seconds(load) if self.costs.timed else None
