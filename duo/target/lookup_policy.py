"""Whether the context lookup's free drafts pay on this request, judged by what their verify rows deliver.

A lookup token costs no drafting, but the row that verifies it costs the target: a step that decodes c lookup rows
after j chain drafts takes T(n) instead of T(n - c) seconds (n: the call's tokens). On a compute-bound CPU target
(Q4_K_M) T(n) grows nearly as n, so rows of a lookup accepted ~0.4 a token (new code) lose; on prose that copies
its prompt, or an edit, they win. Two guards, as for the draft (duo.target.policy, duo.target.switch):

- Each step, by the cost model (duo.target.policy.allocate_with_lookup): lookup tokens join the batch only where
  the call's expected tokens per second with them beat the best plan without them (decoding alone, or the draft's
  chain alone) by LOOKUP_MARGIN. With the lookup's own per-position acceptance b_1, b_2, ... after the chain's j
  drafts, verifying c of them adds a_1 ... a_j (b_1 + b_1 b_2 + ... + b_1 ... b_c) expected tokens for
  T(n) - T(n - c) more seconds; alone (j = 0): E(c) = 1 + b_1 + b_1 b_2 + ... against 1 token in T(1), so it pays
  only where E(c) / T(c + 1) > (1 + LOOKUP_MARGIN) / T(1).
- Over its steps, by what the rows delivered (LookupGate): each step with lookup rows is metered against the same
  step without them, whose outcome is known exactly (the chain's part of the verdict does not depend on the rows
  after it): tokens_without = min(accepted, j) + 1, seconds_without = seconds x T(n - c) / T(n). Every
  JUDGE_STEPS metered steps (a trial: TRIAL_STEPS) the gain sum(tokens) / sum(seconds) over the same without must
  reach 1 + STAY (a trial: 1 + ENTER), else the lookup rests for REST_STEPS x 2^(lost - 1) steps that it proposed
  in, then comes back on trial; sooner where its first token's acceptance rose by RISE since it rested.

While the lookup rests a step decodes exactly what it would without the lookup; the batch's last row, which
decodes anyway, still checks the lookup's first token (at no cost: a step alone verifies it against its one row),
so the lookup's first-position acceptance stays measured, and a text that starts repeating is seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from duo.costs import MovingAverage, StepCosts

LOOKUP_MARGIN = 0.05  # lookup rows must add this share to the plan's expected tokens per second
JUDGE_STEPS = 32      # metered steps per judgement of a lookup that paid
TRIAL_STEPS = 16      # ... of a trial (the first, and each after a rest)
ENTER = 0.05          # a trial must deliver this much over the same steps without the lookup rows
STAY = 0.0            # a lookup that paid stays while it at least matches them
REST_STEPS = 32       # steps with proposals of the first rest; doubled per judgement lost in a row
MAX_DOUBLINGS = 4     # rests of at most REST_STEPS * 16 such steps
RISE = 0.15           # a rest ends early where the first lookup token's acceptance rose this much since it began
FORK_WEIGHT = 4.0     # a new request's meter weighs at most this many of the earlier requests' steps


def _average() -> MovingAverage:
    return MovingAverage(0.0)


@dataclass
class GainMeter:
    """Delivered tokens and seconds of steps with lookup rows, and of the same steps without them (decayed sums:
    the four averages move together, so ratios of their values are ratios of the decayed sums)."""

    tokens: MovingAverage = field(default_factory=_average)
    seconds: MovingAverage = field(default_factory=_average)
    tokens_without: MovingAverage = field(default_factory=_average)
    seconds_without: MovingAverage = field(default_factory=_average)

    def add(self, tokens: float, seconds: float, tokens_without: float, seconds_without: float) -> None:
        for average, x in ((self.tokens, tokens), (self.seconds, seconds),
                           (self.tokens_without, tokens_without), (self.seconds_without, seconds_without)):
            average.add(x)

    def gain(self) -> float | None:
        """(tokens / seconds) / (tokens_without / seconds_without); None before any step."""
        if not self.tokens.weight or self.seconds.value <= 0 or self.tokens_without.value <= 0:
            return None
        return (self.tokens.value / self.seconds.value) / (self.tokens_without.value / self.seconds_without.value)

    def fork(self) -> GainMeter:
        """A copy weighing at most FORK_WEIGHT steps: a request starts from what earlier ones measured, but its own
        text (code, an edit, prose) soon decides."""
        return GainMeter(*(MovingAverage(avg.value, min(avg.weight, FORK_WEIGHT))
                           for avg in (self.tokens, self.seconds, self.tokens_without, self.seconds_without)))


@dataclass
class LookupRecord:
    """What the requests of one verification mode measured of the lookup: a new request's starting point."""

    meter: GainMeter = field(default_factory=GainMeter)
    resting: bool = False
    first_rate_at_rest: float = 0.0


@dataclass
class LookupGate:
    """One request's lookup: running (its tokens may join a step's batch where the cost model says they pay) or
    resting (they never do), judged by the gain its rows delivered."""

    shared: LookupRecord = field(default_factory=LookupRecord)
    meter: GainMeter = field(init=False)
    running: bool = field(init=False)
    established: bool = False  # running, and a judgement confirmed it (STAY applies, not ENTER)
    steps_left: int = TRIAL_STEPS  # running: metered steps until the next judgement; resting: steps with proposals
    lost: int = 0               # judgements lost in a row
    gain: float | None = None   # the latest judgement's
    first_rate_at_rest: float = 0.0  # the first lookup token's acceptance when the rest began
    trials: int = 0             # rests that ended in a trial (the lookup re-probed)

    def __post_init__(self) -> None:
        self.meter = self.shared.meter.fork()
        # A request of a kind the lookup lost on (code) starts resting, as briefly as a first rest: its own text
        # may repeat (an edit), and its first token's acceptance, measured for free, then ends the rest early.
        self.running = not self.shared.resting
        if not self.running:
            self.steps_left, self.first_rate_at_rest = REST_STEPS, self.shared.first_rate_at_rest

    def proposed_unused(self, first_rate: float) -> None:
        """A step where the lookup proposed but decoded no row: a resting lookup counts it down to its next trial,
        or ends the rest now where `first_rate`, its first token's acceptance, rose by RISE since it began."""
        if self.running:
            return
        self.steps_left -= 1
        if self.steps_left <= 0 or first_rate >= self.first_rate_at_rest + RISE:
            self.trials += 1
            self._go(running=True, steps=TRIAL_STEPS)

    def metered(self, tokens: int, seconds: float, tokens_without: int, seconds_without: float,
                first_rate: float) -> None:
        """A step with lookup rows delivered `tokens` in `seconds`; without them it would have delivered
        `tokens_without` in `seconds_without`."""
        self.meter.add(tokens, seconds, tokens_without, seconds_without)
        self.shared.meter.add(tokens, seconds, tokens_without, seconds_without)
        if not self.running:  # rows this gate did not admit (allocate_with_lookup admits none while it rests)
            return
        self.steps_left -= 1
        if self.steps_left <= 0:
            self._judge(first_rate)

    def _judge(self, first_rate: float) -> None:
        self.gain = self.meter.gain()
        if self.gain is not None and self.gain >= 1.0 + (STAY if self.established else ENTER):
            self.lost, self.established = 0, True
            self._go(running=True, steps=JUDGE_STEPS)
            return
        self.lost += 1
        self.established = False
        self.first_rate_at_rest = first_rate
        self._go(running=False, steps=REST_STEPS * 2 ** min(self.lost - 1, MAX_DOUBLINGS))

    def _go(self, running: bool, steps: int) -> None:
        self.running, self.steps_left = running, steps
        self.shared.resting, self.shared.first_rate_at_rest = not running, self.first_rate_at_rest

    def reason(self) -> str:
        """Where the lookup is and why, for the log."""
        gain = f"{self.gain:.2f}x without it" if self.gain is not None else "not judged yet"
        if self.running:
            return f"on ({gain})" if self.established else f"on trial (last {gain})"
        return f"resting ({gain}; next trial in {self.steps_left} steps it proposes in)"


def step_without_rows(n_accepted: int, batch_size: int, lookup_from: int, call_tokens: int, seconds: float,
                      costs: StepCosts) -> tuple[int, int, float]:
    """For a step that decoded c = batch_size - 1 - lookup_from lookup rows after `lookup_from` other drafts, in a
    call of `call_tokens` tokens that took `seconds`: (c, tokens it committed, seconds the same step would have
    taken without the rows). Its outcome without them is exact (the chain's drafts were verified alike): with j
    drafts before the lookup's, min(accepted, j) + 1 tokens (all j accepted: the last row's token)."""
    rows = max(0, batch_size - 1 - lookup_from)
    shorter = costs.batch_seconds(call_tokens - rows) / costs.batch_seconds(call_tokens)
    return rows, min(n_accepted, lookup_from) + 1, seconds * shorter
