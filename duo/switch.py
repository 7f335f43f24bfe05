"""Whether speculation pays on this target, decided by what it delivers: committed tokens per wall-clock
second with the draft on, against the same with the draft off.

The policy's cost model (duo.policy) picks each step's draft length from model-only costs T(n) and the
acceptance; it cannot see what else speculation costs: steps decoded alone while the draft catches up
after a rejection (a draft only a few times faster than the target), the draft stream's messages handled
on the target's core between decodes, a co-running draft slowing the target's memory. On a compute-bound
target these eat the whole gain (the default Q4_K_M pair on a CPU core). So the switch measures both
regimes in the only currency that matters, tokens per second of wall time over whole periods, and keeps
the one that delivers more:

    on for a trial of TRIAL_STEPS ─▶ off for TRIAL_STEPS ─▶ judged:
        on  ≥ (1 + MARGIN) · off  ─▶ on for ON_STEPS, then off for TRIAL_STEPS again (load and content change)
        otherwise                 ─▶ off for TRIAL_STEPS · 2^n (n: trials lost in a row, at most
                                     MAX_DOUBLINGS), then an on trial, judged against the latest off period

Speculation must beat decoding alone by MARGIN to stay on: near break-even the draft's core is better
left idle (and its power unspent). While off, the draft gets no work at all (max_ahead 0: no drafts, no
branches) but for PROBE_LEAD steps before an on trial, so that the trial does not start from nothing.
Cost of the checks: where speculation pays, TRIAL_STEPS of every ON_STEPS + TRIAL_STEPS steps decode
alone (3%); where it does not, the trials come exponentially rarer (under 1% of steps after a while).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

TRIAL_STEPS = 32
ON_STEPS = 1024
MARGIN = 0.05
MAX_DOUBLINGS = 6
PROBE_LEAD = 5


@dataclass
class Switch:
    """One target's regime, shared by all its requests (one model, one draft): a new request starts in
    the regime the last one left, and every request's steps count towards the periods."""

    clock: Callable[[], float] = time.monotonic
    speculating: bool = True
    steps_left: int = TRIAL_STEPS  # in the current period
    on_rate: float | None = None  # tokens per wall second over the last on period
    off_rate: float | None = None  # ... over the last off period
    lost_trials: int = 0  # on trials in a row that did not pay
    _tokens: int = 0  # committed in the current period
    _seconds: float = 0.0  # wall time of its steps
    _last: dict[int, float] = field(default_factory=dict)  # request -> when its previous step ended
    _judging: bool = False  # the current off period is the one that decides
    _warm: bool = False  # the current on period's draft has delivered
    _cold_steps: int = 0  # steps of the current on period before it did

    @property
    def gain(self) -> float | None:
        """The latest on rate over the latest off rate: why the switch is where it is."""
        return self.on_rate / self.off_rate if self.on_rate and self.off_rate else None

    def step_done(self, request: int, tokens: int, verified: int = 0) -> None:
        """A step of `request` committed `tokens`, verifying `verified` drafts: its wall time is since that
        request's previous step (the first step of a request, which holds the prompt's prefill, is not
        counted). An on period counts from its first step that verified drafts: before it, the draft was
        catching up on what was committed while it rested, a cost of the trial, not of speculating (at most
        TRIAL_STEPS such steps are left out, so that a draft that never delivers is judged too)."""
        now = self.clock()
        previous, self._last[request] = self._last.get(request), now
        if previous is None:
            return
        if self.speculating and not self._warm:
            self._warm = verified > 0 or self._cold_steps >= TRIAL_STEPS
            self._cold_steps += 1
            if not self._warm:
                return
        self._tokens += tokens
        self._seconds += now - previous
        self.steps_left -= 1
        if self.steps_left <= 0:
            self._end_period()

    def request_done(self, request: int) -> None:
        self._last.pop(request, None)

    def draft_wanted(self) -> bool:
        """Whether the draft should run: speculating, or about to start an on trial."""
        return self.speculating or self.steps_left <= PROBE_LEAD

    def _end_period(self) -> None:
        """An on period is followed by an off one that measures the alternative and then judges; a lost
        judgement rests the draft for a doubling stretch, after which an on trial starts the cycle again."""
        rate = self._tokens / self._seconds if self._seconds > 0 else None
        self._tokens, self._seconds = 0, 0.0
        if self.speculating:
            self.on_rate = rate
            self._go(False, TRIAL_STEPS, judging=True)
            return
        self.off_rate = rate
        if not self._judging:
            self._go(True, TRIAL_STEPS)
        elif self.on_rate is not None and self.off_rate is not None and self.on_rate >= (1 + MARGIN) * self.off_rate:
            self.lost_trials = 0
            self._go(True, ON_STEPS)
        else:
            self.lost_trials += 1
            self._go(False, TRIAL_STEPS * 2 ** min(self.lost_trials, MAX_DOUBLINGS))

    def _go(self, speculating: bool, steps: int, judging: bool = False) -> None:
        self.speculating, self.steps_left, self._judging = speculating, steps, judging
        self._warm, self._cold_steps = False, 0
