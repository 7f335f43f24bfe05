"""Whether speculation pays on this target, judged by what it delivers: committed tokens per wall-clock
second while the draft works, against the same while it rests.

The policy's cost model (duo.target.policy) picks each step's draft length from model-only costs T(n) and
the acceptance. It cannot see what else speculation costs: steps decoded alone while the draft catches up
after a rejection (a draft only a few times faster than the target), the draft stream's messages handled
between decodes, a co-running draft slowing the target. On a compute-bound target these eat the whole
gain (the default Q4_K_M pair on CPU cores). So the switch measures the on regime in the currency that
matters, tokens per second of wall time, and keeps it only where it beats decoding alone:

    on ── every JUDGE_STEPS warm steps (a trial: TRIAL_STEPS): rate_on vs rate_alone ──▶ stays on while
                                                                     rate_on ≥ (1 + STAY) rate_alone
      └─ else ─▶ off (the draft rests entirely) for REST_STEPS · 2^(n-1) steps (n: judgements lost in a row)
                 ─▶ an on trial, which must reach (1 + ENTER) rate_alone to stay on

rate_alone is measured only while the draft rests: a step decoded alone while the draft works is slowed by
it (on two hyperthreads of one core, or one core shared, twice as slow: a 0.85x regime then "wins" 1.5x).
For one request the first reference is timed when the target starts, before the draft works (one-token
calls on the model thread: model time, so it overrates decoding alone a little, the safe side); a load
without one gets a measuring rest (MEASURE_STEPS) before its first judgement; and the reference is measured again after REMEASURE_FIRST confirmed judgements, then twice as many each time it holds (within
DRIFT), up to REMEASURE_MAX: a changed machine (another process, the heat) is found, and where speculation
pays, the checks cost under 1% of its gain. Hysteresis (ENTER > STAY): a regime near break-even does not
flap.

Both rates are per request and depend on the load: with four clients a step of each takes far longer than
with one. So decoding alone is known per load (the requests stepping), and a period is judged against the
reference of its own load, never one measured under another (a rest measured with four clients would make
any period with one "win" forever). Steps whose call also decoded another request's prompt chunk count in
neither rate: their time is that prompt's.

Decoding alone also depends on the context: each token reads the whole KV cache, so at 16k tokens a step
takes far longer than at a few hundred (T(1) grows with the context). A reference is kept with the context
its steps ran at, and one measured at another context (beyond CONTEXT_SPAN of it) is measured again before a
judgement uses it: against a reference timed as the target started, with an empty cache, speculation at 16k
tokens of context was judged 0.21x decoding alone.

Each request's first steps of a trial are left out of its rate: a rested draft first catches up on what
was committed while it rested (seconds of draft work on a long answer, more with several clients, the
shortest first), a cost of the trial, not of speculating; a request counts from its first verified drafts.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

JUDGE_STEPS = 32     # warm on-steps per judgement of an established regime
TRIAL_STEPS = 16     # ... of a trial: where speculation pays it pays by far (F16: 1.6x and more), and
                     # where it does not, each step of a trial costs the target
MEASURE_STEPS = 8    # steps of a measuring rest: decoding alone varies little from step to step
REST_STEPS = 64      # the first rest; doubled per judgement lost in a row
MAX_DOUBLINGS = 5    # rests of at most REST_STEPS * 32 steps
ENTER = 0.05         # an on trial must beat decoding alone by this much
STAY = 0.0           # an established on regime stays while it at least matches decoding alone
PROBE_LEAD = 5       # steps before a trial that the draft may run, to catch up on the rested stretch
# A trial losing clearly is cut short: after this many warm steps, below (1 - EARLY_LOSS) rate_alone.
EARLY_STEPS = 8
EARLY_LOSS = 0.1
REMEASURE_FIRST = 16  # confirmed judgements before decoding alone is measured again; doubled while it holds
REMEASURE_MAX = 64   # at most this many apart (2048 warm steps)
DRIFT = 0.1          # a reference that moved more than this restarts the doubling
# A reference holds for contexts within this factor of its own, counted from SHORT_CONTEXT (below which the
# cache's reading is a small part of a step): (context + SHORT_CONTEXT) / (its context + SHORT_CONTEXT).
CONTEXT_SPAN = 2 ** 0.5
SHORT_CONTEXT = 1024


@dataclass
class Switch:
    """One target's regime, shared by all its requests (one model, one draft): a new request starts in
    the regime the last one left, and every request's steps count towards the periods."""

    clock: Callable[[], float] = time.monotonic
    speculating: bool = True     # the first requests run an on trial
    established: bool = False    # on, and a judgement confirmed it (STAY applies, not ENTER)
    steps_left: int = TRIAL_STEPS  # in the current period (on: warm steps until the next judgement)
    lost: int = 0                # judgements lost in a row
    gain: float | None = None    # the latest judgement's rate_on / rate_alone
    # load (requests stepping) -> tokens per wall second per request decoding alone, measured over a rest
    rest_rates: dict[int, float] = field(default_factory=dict)
    # load -> the context (tokens in a request's cache, mean over the measured steps) its rest_rates was measured at;
    # a load without one was measured at a short context (as the target starts: an empty cache)
    rest_contexts: dict[int, float] = field(default_factory=dict)
    _remeasure_every: dict[int, int] = field(default_factory=dict)  # load -> confirmed judgements between measures
    _remeasure_in: dict[int, int] = field(default_factory=dict)  # load -> confirmed judgements until the next
    _judging_rest: bool = False  # the current rest measures rate_alone for a judgement
    _on_rate_pending: float | None = None  # the on period's rate that a judging rest is measured against
    _tokens: int = 0             # committed in the current period's counted steps
    _seconds: float = 0.0        # their wall time
    _loads: Counter[int] = field(default_factory=Counter)  # the load of each counted step
    _context_sum: float = 0.0    # the contexts of the counted steps, summed (their mean: the period's context)
    _last: dict[int, float] = field(default_factory=dict)  # request -> when its previous step ended
    _warm: set[int] = field(default_factory=set)  # requests whose draft delivered in this on period
    _cold_steps: dict[int, int] = field(default_factory=dict)  # request -> its steps before that
    # load -> decoding alone estimated from model time (1 / the seconds of a call of `load` tokens), None where the
    # target has timed no call yet: a load's first reference, instead of a measuring rest (see _judge).
    estimate_alone: Callable[[int], float | None] = lambda load: None
    # The target's load (requests stepping) where several switches share one target, each judging its own draft's
    # requests (duo.target.pool): decoding alone is the target's, at the target's load. None: the requests seen here.
    load: Callable[[], int] | None = None

    @property
    def requests(self) -> int:
        """Requests stepping under this switch (between their first step and request_done)."""
        return len(self._last)

    def _load_now(self) -> int:
        return max(1, self.load() if self.load is not None else len(self._last))

    @property
    def rate_alone(self) -> float | None:
        """Tokens per wall second decoding alone at the current period's load, as a rest measured it."""
        return self.rest_rates.get(self._period_load())

    def _period_load(self) -> int:
        """The load most of the current period's counted steps ran at (the load now, before any)."""
        return self._loads.most_common(1)[0][0] if self._loads else self._load_now()

    def draft_wanted(self) -> bool:
        """Whether the draft should work: speculating, or leading into an on trial."""
        return self.speculating or (not self._judging_rest and self.steps_left <= PROBE_LEAD)

    def reason(self) -> str:
        """Why the switch is where it is, for stats and logs."""
        gain = f"{self.gain:.2f}x decoding alone" if self.gain is not None else "not judged yet"
        if self.speculating:
            return f"on ({gain})" if self.established or self.gain is None else f"on trial (last {gain})"
        why = "measuring decoding alone" if self._judging_rest else f"{gain}; next trial in {self.steps_left} steps"
        return f"off ({why})"

    def step_done(self, request: int, tokens: int, verified: int, prefill: bool = False, context: int = 0) -> None:
        """A step of `request` committed `tokens`, verifying `verified` drafts, after `context` tokens of its cache;
        `prefill`: its call also decoded a prompt chunk (its time is not the step's: counted in no rate). Its wall
        time runs since that request's previous step (a request's first step, which holds its prompt, is not
        counted)."""
        now = self.clock()
        previous, self._last[request] = self._last.get(request), now
        if previous is None or prefill:
            return
        seconds = now - previous
        if self.speculating:
            self._on_step(request, tokens, seconds, verified, context)
        else:
            self._rest_step(tokens, seconds, context)

    def request_done(self, request: int) -> None:
        self._last.pop(request, None)
        self._warm.discard(request)
        self._cold_steps.pop(request, None)

    def _on_step(self, request: int, tokens: int, seconds: float, verified: int, context: int) -> None:
        if request not in self._warm:
            cold = self._cold_steps.get(request, 0)
            if not (verified > 0 or cold >= JUDGE_STEPS):
                self._cold_steps[request] = cold + 1
                return
            self._warm.add(request)
        self._count(tokens, seconds, context)
        self.steps_left -= 1
        if self.steps_left <= 0 or self._losing_trial():
            self._judge(self._take_rate())

    def _count(self, tokens: int, seconds: float, context: int) -> None:
        self._tokens += tokens
        self._seconds += seconds
        self._loads[self._load_now()] += 1
        self._context_sum += context

    def _period_context(self) -> float:
        """The mean context of the current period's counted steps (0 before any)."""
        steps = sum(self._loads.values())
        return self._context_sum / steps if steps else 0.0

    def _reference_holds(self, load: int, context: float) -> bool:
        """Whether decoding alone at `load` was measured at a context near enough `context` (CONTEXT_SPAN)."""
        ratio = (context + SHORT_CONTEXT) / (self.rest_contexts.get(load, 0.0) + SHORT_CONTEXT)
        return 1.0 / CONTEXT_SPAN <= ratio <= CONTEXT_SPAN

    def _losing_trial(self) -> bool:
        """A trial (not an established regime) that after EARLY_STEPS warm steps is clearly below decoding
        alone as measured over a rest at this context: what it would cost to finish is spent for nothing (the
        default Q4_K_M pair on a CPU)."""
        alone = self.rate_alone
        return (not self.established and alone is not None and TRIAL_STEPS - self.steps_left >= EARLY_STEPS
                and self._reference_holds(self._period_load(), self._period_context())
                and self._tokens < (1.0 - EARLY_LOSS) * alone * self._seconds)

    def _rest_step(self, tokens: int, seconds: float, context: int) -> None:
        self._count(tokens, seconds, context)
        self.steps_left -= 1
        if self.steps_left > 0:
            return
        load, measured_at = self._period_load(), self._period_context()
        if (rate := self._take_rate()) is not None:
            self._measured(load, rate, measured_at)
        if self._judging_rest:
            self._judge(self._on_rate_pending)
        else:
            self._go(True, TRIAL_STEPS)  # an on trial

    def _measured(self, load: int, rate: float, context: float) -> None:
        """Decoding alone at `load` was measured at `rate` after `context` tokens: measure it again sooner if it
        moved (or was measured at another context), later if not."""
        before = self.rest_rates.get(load)
        held = (before is not None and abs(rate / before - 1.0) <= DRIFT
                and self._reference_holds(load, context))
        every = min(2 * self._remeasure_every.get(load, REMEASURE_FIRST), REMEASURE_MAX) if held else REMEASURE_FIRST
        self.rest_rates[load], self._remeasure_every[load], self._remeasure_in[load] = rate, every, every
        self.rest_contexts[load] = context

    def _take_rate(self) -> float | None:
        rate = self._tokens / self._seconds if self._seconds > 0 else None
        self._tokens, self._seconds = 0, 0.0  # the period's load and context stay until it is judged
        return rate

    def _judge(self, rate_on: float | None) -> None:
        """Keep speculating if the on period beat decoding alone by the margin, else rest (doubling); measure
        decoding alone first where this load has no reference, one measured at another context, or its next
        measure is due."""
        load, context = self._period_load(), self._period_context()
        self._loads.clear()
        if rate_on is None:
            self._rest()
            return
        # A load's first reference is estimated from model time where it can be, as the first request's is (a rest
        # for each new load is many alone steps where loads change often: short answers, clients coming and going);
        # it overrates decoding alone a little, the safe side, and is measured for real after REMEASURE_FIRST
        # confirmed judgements. A reference of unknown age (given at construction) is trusted as a fresh measure is.
        if load not in self.rest_rates and (estimate := self.estimate_alone(load)) is not None:
            self.rest_rates[load] = estimate
        if (load not in self.rest_rates or self._remeasure_in.setdefault(load, REMEASURE_FIRST) <= 0
                or not self._reference_holds(load, context)):
            self._on_rate_pending = rate_on
            self._go(False, MEASURE_STEPS, judging=True)
            return
        self.gain = rate_on / self.rest_rates[load]
        margin = STAY if self.established else ENTER
        if self.gain >= 1.0 + margin:
            self.lost, self.established = 0, True
            self._remeasure_in[load] -= 1
            self._go(True, JUDGE_STEPS)
        else:
            self._rest()

    def _rest(self) -> None:
        self.lost += 1
        self.established = False
        self._go(False, REST_STEPS * 2 ** min(self.lost - 1, MAX_DOUBLINGS))

    def _go(self, speculating: bool, steps: int, judging: bool = False) -> None:
        if speculating and not self.speculating:  # a trial: each request's rested draft catches up first
            self._warm.clear()
            self._cold_steps.clear()
        self.speculating, self.steps_left, self._judging_rest = speculating, steps, judging
        self._tokens, self._seconds, self._context_sum = 0, 0.0, 0.0
        self._loads.clear()
