"""What both processes' schedulers learn from: running averages, and T(n), a model call's seconds by its tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

# Exponential moving averages forget old measurements at this rate per observation, so the policy
# follows a change of content (code vs prose) or of load within a few dozen steps.
DECAY = 0.95
# Before anything is measured, assume a call of n tokens costs 1 + 0.1 (n - 1) single-token calls:
# optimistic enough that longer calls are tried, so that they are measured.
PRIOR_BATCH_SLOPE = 0.1


@dataclass
class MovingAverage:
    """An exponential moving average that forgets at DECAY per observation; `weight` is how many
    observations it holds (a prior given as a starting weight counts as that many)."""

    value: float
    weight: float = 0.0  # 0 until the first observation

    def add(self, x: float) -> None:
        self.weight = self.weight * DECAY + 1.0
        self.value += (x - self.value) / self.weight


@dataclass
class StepCosts:
    """T(n): the seconds of model work a verify batch of n tokens takes.

    One model on one machine: every request measures the same costs, so all share one StepCosts.
    Only the model call is timed, never the wait behind other requests' steps or prefills.
    """

    step_seconds: dict[int, MovingAverage] = field(default_factory=dict)  # batch size -> T

    def observe(self, batch_size: int, seconds: float) -> None:
        self.step_seconds.setdefault(batch_size, MovingAverage(seconds)).add(seconds)

    @property
    def timed(self) -> bool:
        """Whether any batch size was measured (before that, batch_seconds is the prior's, in units of T(1))."""
        return any(average.weight for average in self.step_seconds.values())

    def measured_seconds(self, n: int) -> float | None:
        """T(n) where batches of n were measured, else None."""
        average = self.step_seconds.get(n)
        return average.value if average is not None and average.weight else None

    def batch_seconds(self, n: int) -> float:
        """T(n): measured; else interpolated between measured sizes; else, beyond them, optimistic.

        A larger batch than any measured is assumed to cost only PRIOR_BATCH_SLOPE more per token, so
        the policy tries it once and learns its real cost. Extrapolating the measured slope instead
        would trap it: on a CPU, going from 1 to 2 tokens switches matrix kernels and costs far more
        than each token after that (F16 1.5B on one core: T(2) = 1.75 T(1) but T(5) = 2.2 T(1)).
        """
        measured = sorted((size, avg.value) for size, avg in self.step_seconds.items() if avg.weight)
        if not measured:
            return 1.0 + PRIOR_BATCH_SLOPE * (n - 1)
        for size, seconds in measured:
            if size == n:
                return seconds
        below = [(s, t) for s, t in measured if s < n]
        above = [(s, t) for s, t in measured if s > n]
        if below and above:
            (s0, t0), (s1, t1) = below[-1], above[0]
            return t0 + (t1 - t0) * (n - s0) / (s1 - s0)
        if below:
            size, seconds = below[-1]
            return seconds * (1 + PRIOR_BATCH_SLOPE * (n - size))
        size, seconds = above[0]
        return seconds / (1 + PRIOR_BATCH_SLOPE * (size - n))
