"""Adaptive speculation: how many draft tokens to verify per step, from live cost and acceptance measurements."""

from __future__ import annotations

from dataclasses import dataclass, field

from duo.costs import MovingAverage, StepCosts
from duo.target.confidence import Calibration
from duo.target.lookup_policy import LOOKUP_MARGIN, LookupGate, LookupRecord, step_without_rows
from duo.target.switch import Switch

# Before anything is measured, assume drafts are accepted at 0.7 (and a verify batch costs what
# duo.costs.StepCosts assumes): optimistic enough that speculation is tried, so that it is measured.
# The acceptance prior weighs as much as PRIOR_WEIGHT observations, so one early rejection does
# not switch speculation off.
PRIOR_ACCEPTANCE = 0.7
PRIOR_WEIGHT = 2.0
# Now and then verify one more draft token than the best choice, so estimates for longer drafts
# stay fresh even when the policy has settled on short ones (or none).
EXPLORE_EVERY = 16
# When no draft length pays by the cost model, the draft rests (on a shared memory bus its work slows
# the target) except from this many steps before each exploration until the exploration has happened:
# a rested draft first catches up on the committed tokens, then drafts. Whether speculation pays at
# all, by what it delivers, is duo.target.switch's to say: while it is off the draft rests entirely.
PROBE_LEAD = 5
# A step with drafts must beat decoding alone by this share in the cost model: where T(2)/T(1) sits
# next to E(1) (a compute-bound target), noise in either would otherwise turn drafting on and off.
DRAFT_MARGIN = 0.03


# A step never waits longer than this share of a step alone: where waiting pays (a draft many times
# faster than the target), the wait is a small fraction of it anyway.
MAX_WAIT_OF_A_STEP = 0.5


@dataclass
class Acceptance:
    """a_i for each chain position i: the chance that draft i is accepted given that drafts before it were."""

    rates: list[MovingAverage]

    @classmethod
    def prior(cls, max_draft: int) -> Acceptance:
        return cls([MovingAverage(PRIOR_ACCEPTANCE, PRIOR_WEIGHT) for _ in range(max_draft + 1)])

    def fork(self) -> Acceptance:
        """A copy that weighs no more than the prior: a new request starts from what earlier requests
        of its sampling mode measured, but its own content (code, prose) soon decides."""
        return Acceptance([MovingAverage(avg.value, min(avg.weight, PRIOR_WEIGHT)) for avg in self.rates])

    def observe(self, n_verified: int, n_accepted: int) -> None:
        # Position i was tried only if drafts 0..i-1 were accepted: positions past the first
        # rejection say nothing.
        for position in range(min(n_verified, n_accepted + 1, len(self.rates))):
            self.rates[position].add(1.0 if position < n_accepted else 0.0)


@dataclass
class DraftTiming:
    """How soon drafts come back after a commit, measured on the target from the stream.

    After a commit that left a session without drafts (a rejection no branch covered), the draft
    must hear of it, roll back and draft again: its first token arrives `latency` seconds after the
    commit went out (the link's round trip plus one draft step), and each further one `per_token`
    seconds later. One draft serves every request, so one DraftTiming serves them all.
    """

    latency: MovingAverage = field(default_factory=lambda: MovingAverage(0.0))
    per_token: MovingAverage = field(default_factory=lambda: MovingAverage(0.0))

    @property
    def measured(self) -> bool:
        return self.latency.weight > 0 and self.per_token.weight > 0

    def seconds_until(self, n: int, since_commit: float) -> float:
        """Expected seconds from now until n drafts are pending, `since_commit` seconds after the commit."""
        return max(0.0, self.latency.value - since_commit) + (n - 1) * self.per_token.value


@dataclass
class AdaptivePolicy:
    """Chooses one request's draft length k that maximises expected committed tokens per second.

    A step that verifies k drafts decodes k + 1 tokens in T(k + 1) seconds and commits
    E(k) = 1 + a1 + a1 a2 + ... + a1 a2 ... ak tokens on average, where ai is the chance that draft
    i is accepted given that drafts 1..i-1 were. So k = argmax E(k) / T(k + 1) over the drafts
    that are pending, k = 0 (decode alone) included. Example: a = 0.8 everywhere, T(n) = n * T(1)
    (a compute-bound CPU target): E(1) / T(2) = 1.8 / 2 < 1 / T(1), so decode alone; with
    T(n) = (1 + 0.1 (n - 1)) T(1) (memory-bound): E(4) / T(5) = 3.36 / 1.4 = 2.4 per T(1).

    T is shared by all requests (`costs`); the acceptance is this request's own, started from and
    feeding back into `shared`, the estimate of every request of its sampling mode (greedy and
    sampled drafts are accepted at very different rates).

    Where the draft sent its confidence in this step's pending drafts (duo.target.confidence), a draft's ai is the
    `calibration`'s acceptance at that confidence alone, once its bin has seen a draft, and the positional rate
    otherwise: the draft's probability of the very token says more about this text than what drafts at position i
    of other steps did (a request's first steps otherwise draft at rates other requests measured), and the
    calibration, shared by the mode's requests, is learnt from its first request on; an unobserved bin knows only
    its prior, and the positional rate is measured. Drafts not yet pending (the lead, a wait) keep the positional
    rates: their confidence is unknown.
    """

    max_draft: int = 16
    costs: StepCosts = field(default_factory=StepCosts)
    shared: Acceptance | None = None
    acceptance: Acceptance = field(init=False)
    switch: Switch = field(default_factory=Switch)  # whether speculation pays: shared by the target's requests
    # Free drafts (the context lookup's, the grammar's forced text: duo.lookup) are accepted at rates of
    # their own, learnt apart from the model's; free_from: where this step's pending drafts turn free (None: none).
    shared_free: Acceptance | None = None
    free: Acceptance = field(init=False)
    free_from: int | None = None
    # The context lookup's drafts, apart from the grammar's forced ones before them: where this step's pending drafts
    # turn to the lookup's (None: it proposed none), and whether they pay here (duo.target.lookup_policy).
    shared_lookup: LookupRecord | None = None
    lookup: LookupGate = field(init=False)
    lookup_from: int | None = None
    # Acceptance by the draft's confidence, shared by the mode's requests (None: positional rates alone), and the
    # calibrated rate of each of this step's pending chain drafts (None: no confidence, or its bin unobserved).
    calibration: Calibration | None = None
    calibrated: list[float | None] = field(default_factory=list)
    confidences: list[float | None] = field(default_factory=list)
    draft_len: int = 0  # the best draft length given enough pending drafts (0 while off): exposed in metrics
    preferred: int = 0  # the same by the cost model alone, whatever the switch says
    _steps: int = 0
    _explore_due: bool = False  # an exploration waits for a step with drafts to explore with

    def __post_init__(self) -> None:
        self.acceptance = self.shared.fork() if self.shared else Acceptance.prior(self.max_draft)
        self.free = self.shared_free.fork() if self.shared_free else Acceptance.prior(self.max_draft)
        self.lookup = LookupGate(self.shared_lookup or LookupRecord())
        # What the draft should run ahead by from the session's start, so that the first step can verify drafts.
        self._prefer(allocate([self], [self.max_draft], self.costs)[0])

    def _prefer(self, preferred: int) -> None:
        self.preferred = preferred
        self.draft_len = preferred if self.switch.speculating else 0

    def choose(self, n_pending: int) -> int:
        """How many of the `n_pending` drafts to put in this step's batch (a step of this request alone)."""
        return choose_together([self], [n_pending], self.costs)[0]

    def settle(self, best: int, limit: int, preferred: int) -> int:
        """This step's draft length: `best` (of at most `limit`), or one more now and then to explore;
        `preferred` is the best length with as many drafts as the request could want (for max_ahead);
        0 while the switch has speculation off (the regime it measures decodes alone)."""
        self._prefer(preferred)
        if not self.switch.speculating:
            return best if self.free_from == 0 else 0  # resting, free drafts alone may still pay
        self._steps += 1
        self._explore_due |= self._steps % EXPLORE_EVERY == 0
        if self._explore_due and best < limit:
            self._explore_due = False
            best += 1
        return best

    def wait_for(self, timing: DraftTiming, since_commit: float) -> tuple[int, float]:
        """With no drafts pending: (k, seconds) to wait for k drafts known to be coming, or (0, 0.0)
        when decoding alone now is faster in expectation.

        Waiting w seconds, then verifying k drafts, commits E(k) tokens in w + T(k + 1). Decoding
        alone does not idle the draft: the fair rival is a step alone, then a step verifying the m
        drafts that arrived during it. The first of them must equal the token decoded alone (chance
        a1), else that step is alone too: 1 + a1 E(m - 1) + (1 - a1) tokens in
        T(1) + a1 T(m) + (1 - a1) T(1). Example, a = 0.8, T(n) = 140 ms (1 + 0.04 (n - 1)): a draft
        35 ms after the commit then every 35 ms (4x the target's pace) does not pay a wait (12.1
        tokens/s alone-then-verify against at best 11.3 waiting); one 10 ms after and every 5 ms
        does (18.8 tokens/s waiting 45 ms for 8 drafts against 14.8).
        """
        if not timing.measured:
            return 0, 0.0
        best = (0, 0.0, self._rate_after_a_step_alone(timing, since_commit))
        for k in range(1, self.max_draft + 1):
            wait = timing.seconds_until(k, since_commit)
            if wait > MAX_WAIT_OF_A_STEP * self.costs.batch_seconds(1):
                break  # a long wait rests on a long extrapolation of the draft's pace: not worth the risk
            rate = self.expected_tokens(k) / (wait + self.costs.batch_seconds(k + 1))
            if rate > best[2]:
                best = (k, wait, rate)
        return best[0], best[1]

    def _rate_after_a_step_alone(self, timing: DraftTiming, since_commit: float) -> float:
        """Tokens per second of a step alone now, then a step verifying what the draft sent meanwhile."""
        alone = self.costs.batch_seconds(1)
        arrived = [n for n in range(1, self.max_draft + 2) if timing.seconds_until(n, since_commit) <= alone]
        m = max(arrived, default=0)
        if m < 2:
            return 1.0 / alone
        a1 = self.rate(0)
        tokens = 1.0 + a1 * self.expected_tokens(m - 1) + (1.0 - a1)
        seconds = alone + a1 * self.costs.batch_seconds(m) + (1.0 - a1) * alone
        return tokens / seconds

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a step verifying k drafts commits on average (the bonus or recovered token included)."""
        expected, survive = 1.0, 1.0
        for position in range(k):
            survive *= self.rate(position)
            expected += survive
        return expected

    def rate(self, position: int) -> float:
        """The chance that this step's draft at `position` is accepted given those before it were: the model's
        rate for its chain's drafts, the free drafts' rate (from their own first position) after them."""
        if self.free_from is None or position < self.free_from:
            calibrated = self.calibrated[position] if position < len(self.calibrated) else None
            return self.acceptance.rates[position].value if calibrated is None else calibrated
        return self.free.rates[position - self.free_from].value

    def judge_pending(self, confidences: list[float | None]) -> None:
        """This step's pending chain drafts carry these confidences (until observe_acceptance ends the step)."""
        self.confidences = confidences
        if self.calibration is not None:
            self.calibrated = [None if confidence is None else self.calibration.rate(confidence)
                               for confidence in confidences]

    def observe(self, batch_size: int, n_verified: int, n_accepted: int, seconds: float) -> None:
        """Learn from one step: its cost (model work only), and which draft positions were accepted."""
        self.costs.observe(batch_size, seconds)
        self.observe_acceptance(n_verified, n_accepted)

    def observe_acceptance(self, n_verified: int, n_accepted: int) -> None:
        """Learn which draft positions were accepted (a batched step's cost is the whole call's: the
        caller records it in `costs` once)."""
        chain = n_verified if self.free_from is None else min(n_verified, self.free_from)
        if chain:
            self.acceptance.observe(chain, n_accepted)
            if self.shared:
                self.shared.observe(chain, n_accepted)
            if self.calibration is not None:
                self.calibration.observe(self.confidences[:chain], n_accepted)
        if n_verified > chain and n_accepted >= chain:  # the free drafts were reached
            self.free.observe(n_verified - chain, n_accepted - chain)
            if self.shared_free:
                self.shared_free.observe(n_verified - chain, n_accepted - chain)
        self.free_from = self.lookup_from = None  # the step is over: what comes next (a wait, the lead) is the model's
        self.confidences, self.calibrated = [], []  # and its drafts' confidences are unknown

    def observe_lookup(self, batch_size: int, n_accepted: int, call_tokens: int, seconds: float) -> int | None:
        """Meter a step (before observe_acceptance ends it): the lookup rows it decoded, None where it proposed none."""
        if self.lookup_from is None:
            return None
        first_rate = self.rate(self.lookup_from)
        rows, tokens_without, seconds_without = step_without_rows(n_accepted, batch_size, self.lookup_from,
                                                                  call_tokens, seconds, self.costs)
        if rows:  # committed: the accepted drafts and one more, at most a token per row
            self.lookup.metered(min(n_accepted + 1, batch_size), seconds, tokens_without, seconds_without, first_rate)
        else:
            self.lookup.proposed_unused(first_rate)
        return rows

    def chain_end(self, n_pending: int) -> int:
        """The pending drafts before the lookup's: what an exploration may reach (the lookup has trials of its own)."""
        return n_pending if self.lookup_from is None else min(n_pending, self.lookup_from)

    def max_ahead(self) -> int:
        """How far ahead of the committed tokens the draft should run.

        After a step that accepts all k drafts and adds one token, the next step again wants k
        drafts beyond the new end: the draft must already have run 2k + 1 ahead of the old one. It
        follows the preferred length, not this step's choice: when a step found few drafts pending,
        shortening the lead would only make the next step find fewer. When the preferred length is
        0, the draft rests but for a short probe before each exploration step; while the switch has
        speculation off, it rests entirely but for a lead into the next on trial.
        """
        if not self.switch.speculating:
            return 2 * max(self.preferred, 1) + 2 if self.switch.draft_wanted() else 0
        if self.draft_len == 0:
            probing = self._explore_due or self._steps % EXPLORE_EVERY >= EXPLORE_EVERY - PROBE_LEAD
            return 2 if probing else 0
        return 2 * self.draft_len + 2


@dataclass(frozen=True)
class StepPlan:
    """What one step of a request verifies (planned by duo.target.control): the draft's chain, unless the switch
    rests the draft (free drafts may still pay). How many drafts, and whether the lookup's join, the batched call
    decides for every request at once by each one's `policy` (choose_together; None: not adaptive, all it may)."""

    policy: AdaptivePolicy | None
    chain: bool


def allocate(policies: list[AdaptivePolicy], limits: list[int], costs: StepCosts, other_tokens: int = 0,
             with_free: bool = True) -> list[int]:
    """Draft lengths k_s <= limits[s] for requests verified in one batched call that maximise the
    call's expected committed tokens per second, sum_s E_s(k_s) / T(other_tokens + sum_s (k_s + 1)).

    A split with drafts must beat decoding alone by DRAFT_MARGIN. Each request's next draft adds the
    chance that it and all drafts before it are accepted, a1 ... ak,
    which only shrinks as k grows. So for any total number of drafts, the best split takes drafts one
    at a time, each from the request whose next draft is likeliest to be accepted; the best total is
    then the best point on that path. With one request this is argmax_k E(k) / T(k + 1). Example:
    two requests accepting 0.9 and 0.5 per draft share a call whose cost grows slowly: the first gets
    drafts until 0.9^k falls below 0.5, then they alternate.
    """
    def accepted(s: int, k: int) -> float:  # without the free drafts: the model's rates alone (the draft's lead)
        return policies[s].rate(k) if with_free else policies[s].acceptance.rates[k].value

    ks = [0] * len(policies)
    survive = [1.0] * len(policies)  # a1 ... ak of each request's drafts so far
    expected = float(len(policies))  # E_s(0) = 1: each step commits at least one token
    tokens = other_tokens + len(policies)
    best, best_rate = list(ks), expected / costs.batch_seconds(tokens) * (1.0 + DRAFT_MARGIN)
    while True:
        growing = [s for s, policy in enumerate(policies) if ks[s] < min(limits[s], policy.max_draft)]
        if not growing:
            return best
        s = max(growing, key=lambda s: survive[s] * accepted(s, ks[s]))
        survive[s] *= accepted(s, ks[s])
        ks[s] += 1
        expected += survive[s]
        tokens += 1
        rate = expected / costs.batch_seconds(tokens)
        if rate > best_rate:
            best, best_rate = list(ks), rate


def choose_together(policies: list[AdaptivePolicy], n_pending: list[int], costs: StepCosts,
                    other_tokens: int = 0) -> list[int]:
    """Each request's draft length in one batched call (allocate), explorations included; each
    policy's preferred length (draft_len, which steers how far its draft runs ahead) is the one it
    would get if every request had all the drafts it could use."""
    if policies and not any(policy.switch.speculating for policy in policies):
        # Resting: the draft's chains wait (verify_work sends none) and the plan for the next trial's lead is the
        # last one; free drafts, which cost no drafting, are verified where the cost model says they pay.
        chosen = allocate_with_lookup(policies, [n if policy.free_from == 0 else 0
                                                 for policy, n in zip(policies, n_pending)], costs, other_tokens)
        return [policy.settle(k, 0, policy.preferred) for policy, k in zip(policies, chosen)]
    chosen = allocate_with_lookup(policies, n_pending, costs, other_tokens)
    preferred = allocate(policies, [policy.max_draft for policy in policies], costs, other_tokens, with_free=False)
    return [policy.settle(k, min(policy.chain_end(n), policy.max_draft), pref)
            for policy, k, n, pref in zip(policies, chosen, n_pending, preferred)]


def allocate_with_lookup(policies: list[AdaptivePolicy], limits: list[int], costs: StepCosts,
                         other_tokens: int = 0) -> list[int]:
    """allocate, with the context lookup's drafts only where they pay (duo.target.lookup_policy).

    The best plan without lookup tokens (limits cut where they start) against the best with those of every request
    whose lookup runs: the lookup's rows join only where the call's expected rate, sum_s E_s(k_s) / T(other_tokens +
    sum_s (k_s + 1)) with E_s(k) = 1 + r_1 + r_1 r_2 + ... + r_1 ... r_k (r_i: the chain's acceptance, then the
    lookup's own by position), beats the plan without by LOOKUP_MARGIN. Alone and with no chain: E(c) / T(c + 1)
    against (1 + LOOKUP_MARGIN) / T(1). A resting lookup adds nothing: the step is the one without it."""
    without = [policy.chain_end(n) for policy, n in zip(policies, limits)]
    plain = allocate(policies, without, costs, other_tokens)
    admitted = [n if policy.lookup.running else cut for policy, n, cut in zip(policies, limits, without)]
    if admitted == without:
        return plain
    looked = allocate(policies, admitted, costs, other_tokens)
    if split_rate(policies, looked, costs, other_tokens) > (1.0 + LOOKUP_MARGIN) * split_rate(policies, plain, costs,
                                                                                               other_tokens):
        return looked
    return plain


def split_rate(policies: list[AdaptivePolicy], ks: list[int], costs: StepCosts, other_tokens: int = 0) -> float:
    """Expected committed tokens per second of a call verifying ks[s] drafts of each request."""
    tokens = other_tokens + sum(k + 1 for k in ks)
    return sum(policy.expected_tokens(k) for policy, k in zip(policies, ks)) / costs.batch_seconds(tokens)
