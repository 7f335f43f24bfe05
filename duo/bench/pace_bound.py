"""The pace-aware bound: the best rate a speculative schedule can reach with a draft of measured speed.

The ideal bound max_k E(k) / T(k + 1) (bench_report.ideal_rate) assumes k drafts are ready the moment
the target wants them. A real draft needs `d` seconds per token: after a rejection it first hears of
the commit (the link's one-way delay l), then decodes the corrected token and drafts again, so the step
after a rejection finds at most (elapsed - l) / d drafts. This module simulates that pipeline from
measured costs, Monte Carlo, for a family of schedules, and takes the best:

- the draft drafts the chain without pause and without a cap on its lead (the most a chain-only draft
  can give), restarting l + d after the commit that rejected its token;
- each target step verifies min(pending, k) drafts in a batch of that many plus one, whose last row
  also checks one more pending draft (a bonus equal to the next draft keeps the chain alive);
- before a step the target may wait up to w for the k-th draft, when that draft will come within w
  (the simulation knows arrival times: no schedule can wait better);
- tokens are accepted independently with the measured per-token acceptance a.

Branches are left out: a draft that also prepares the corrected token's continuation at doubtful
positions can beat this bound (duo's branch hits), so a share above 100% is possible and says so.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WAITS_OF_A_STEP = (0.0, 0.25, 0.5, 1.0)  # the waits tried, as shares of T(1)
TOKENS = 6000                            # simulated per schedule: enough for ±1% on the rate


@dataclass(frozen=True)
class PaceBound:
    tokens_per_second: float
    k: int          # the best schedule's most drafts per step
    wait_s: float   # and its longest wait for them


def batch_cost(costs: dict[int, float], n: int) -> float:
    """T(n), interpolated between measured sizes and extended by the last measured slope."""
    if n in costs:
        return costs[n]
    sizes = sorted(costs)
    below = [s for s in sizes if s < n]
    above = [s for s in sizes if s > n]
    if below and above:
        s0, s1 = below[-1], above[0]
        return costs[s0] + (costs[s1] - costs[s0]) * (n - s0) / (s1 - s0)
    s0, s1 = sizes[-2], sizes[-1]
    return costs[s1] + (costs[s1] - costs[s0]) / (s1 - s0) * (n - s1)


def simulate(acceptance: float, costs: dict[int, float], draft_s: float, link_s: float, k: int, wait_s: float,
             seed: int = 0) -> float:
    """Committed tokens per second of the schedule (k, wait_s), over TOKENS tokens."""
    rng = random.Random(seed)
    now = 0.0
    committed = 0
    # The draft's line: it holds drafts for positions committed, committed + 1, ...; the i-th of them
    # (0-based) arrives at line_start + (i + 1 + behind) * draft_s, where `behind` counts drafts of
    # the line already committed (they were made before the commit and cost no new time).
    line_start, line_offset = 0.0, 0  # the line began at line_start with the draft at position line_offset
    while committed < TOKENS:
        def arrival(position: int) -> float:
            return line_start + (position - line_offset + 1) * draft_s

        kth = arrival(committed + k - 1)
        if now < kth <= now + wait_s:
            now = kth  # wait for the k-th draft
        pending = 0
        while pending <= k and arrival(committed + pending) <= now:
            pending += 1  # drafts ready (one beyond k at most: the last row checks it)
        batch = min(pending, k)
        now += batch_cost(costs, batch + 1)
        accepted = 0
        while accepted < pending and rng.random() < acceptance:
            accepted += 1
        if accepted == pending and pending > batch:
            committed += batch + 1  # every verified draft and the one beyond: the chain lives on
            continue
        committed += min(accepted, batch) + 1
        if accepted < pending or rng.random() >= acceptance:
            # A rejection, or a bonus token the draft had not reached (it matches the draft's next with
            # chance a): the draft hears of the commit, decodes it, and drafts a new line from there.
            line_start, line_offset = now + link_s, committed
        # else: the bonus equals what the draft is drafting: its line continues
    return committed / now


def pace_bound(acceptance: float, costs: dict[int, float], draft_s: float, link_s: float = 0.0) -> PaceBound:
    """The best schedule of the family over k = 0 .. the largest measured batch - 1 and the waits tried."""
    best = PaceBound(1.0 / costs[1], 0, 0.0)
    for k in range(1, max(costs)):
        for share in WAITS_OF_A_STEP:
            rate = simulate(acceptance, costs, draft_s, link_s, k, share * costs[1])
            if rate > best.tokens_per_second:
                best = PaceBound(rate, k, share * costs[1])
    return best
