"""What one more draft round is worth: the draft's scheduler spends each round where it is expected to
commit the most tokens.

A step of the target that verifies drafts commits E = 1 + S_1 + S_2 + ... tokens, where S_d is the chance
that the drafts at depths 1..d beyond the committed tokens are all accepted (duo.target.policy). So one drafted
token is worth the chance that it ends up committed, and a round (one token) can go to:

- the chain's lead, depth d = L + 1 after L drafts: worth S_L * a, a its own acceptance;
- a branch forking at depth j, assuming the target commits the alternative token there (duo.draft.branches):
  the branch is used when drafts 1..j-1 are accepted, the one at j is not, and the target's token is the
  alternative; its m-th drafted token is then worth
      S_(j-1) * (1 - a_j) * r * a'_1 ... a'_m,
  r the chance that a rejected position's token is the alternative, a' its drafts' acceptances.

Each a_d is the draft's confidence at depth d, calibrated by what the commits showed: the draft's two-
token confidence sigmoid(margin) (the top token's share of the top two, from logits it has anyway) is
scaled so that its average over judged positions equals the measured acceptance: a = c * alpha / c_mean.
Commits tell the draft which of its tokens were accepted and which alternative the target took, the same
events the target's acceptance estimates come from, so no estimate needs to travel: the target tells only
its planned verify length k and horizon (max_ahead = 2k + 2: the chain serves the step in flight and the
one after it). Branches end at k tokens: the step after a hit verifies at most k. The chain is drafted to
that horizon whatever its worth (the target counts on it: its wait for drafts does), but a branch round
worth less than MIN_VALUE is not: with the chain done and no branch worth it, the draft's core idles.

The chain and the branch live in sequences of their own, so one decode can grow both: a decode of two
tokens costs far less than two of one where the weights' reading dominates (a CPU draft: 1.2x; a GPU:
next to 1x). A session's second round rides along in a decode when its value pays for the time it adds
to the whole decode (with_riders, the cost measured by RoundCost).

Example, k = 4, acceptance 0.85 everywhere but at depth 2, where the draft is unsure (a_2 = 0.3): the
chain's token at depth 6 is worth 0.85^5 * 0.3 = 0.13, a branch forking at depth 2 0.85 * 0.7 * r * a'
= 0.85 * 0.7 * 0.5 * 0.85 = 0.25 for its first token and 0.21 for its second: the doubt draws the next
rounds to the branch, and the lead rides along where one more token adds less than half to a decode
of this session alone (0.13 >= extra * 0.25). Where the draft is sure (0.85 at depth 2 too), the same
branch is worth 0.85 * 0.15 * 0.5 * 0.85 = 0.05 against 0.38 for the lead at depth 6: doubt decides
where rounds go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from duo.costs import MovingAverage, StepCosts
from duo.draft.branches import Branch, Doubt

# The draft's own estimates before any commit judged it: accepted at 0.7, and the alternative the
# target's token at half of the rejections.
PRIOR_ACCEPTANCE = 0.7
PRIOR_ALTERNATIVE = 0.5
# A branch round expected to commit fewer tokens than this is not worth the draft's core (nor the bus it shares).
MIN_VALUE = 0.02
# Calibrated acceptances stay inside this range: one judgement never makes a position certain.
CLAMP = (0.02, 0.98)
# Rounds are timed by their tokens up to this many (longer ones are a prompt's catch-up, not drafting).
MAX_TIMED_TOKENS = 64


@dataclass
class Calibration:
    """What commits showed of one session's drafts: acceptance, the confidence of the judged tokens, and
    how often a rejected position's token was the draft's alternative."""

    # Each starts from its prior, weighing as one judgement, and follows the judgements as duo.target.policy's do.
    acceptance: MovingAverage = field(default_factory=lambda: MovingAverage(PRIOR_ACCEPTANCE, 1.0))
    confidence: MovingAverage = field(default_factory=lambda: MovingAverage(PRIOR_ACCEPTANCE, 1.0))
    alternative: MovingAverage = field(default_factory=lambda: MovingAverage(PRIOR_ALTERNATIVE, 1.0))

    def judge(self, doubt: Doubt | None, accepted: bool, committed_token: int) -> None:
        """Learn from one drafted token the target decided: kept, or replaced by committed_token."""
        self.acceptance.add(1.0 if accepted else 0.0)
        if doubt is None:
            return
        self.confidence.add(confidence(doubt))
        if not accepted and doubt.alternative is not None:
            self.alternative.add(1.0 if committed_token == doubt.alternative else 0.0)

    def acceptance_at(self, doubt: Doubt | None) -> float:
        """a at a drafted position: its confidence calibrated to the measured acceptance."""
        if doubt is None:
            return self.acceptance.value
        scaled = confidence(doubt) * self.acceptance.value / max(self.confidence.value, CLAMP[0])
        return min(max(scaled, CLAMP[0]), CLAMP[1])


@dataclass
class RoundCost:
    """The seconds a draft round takes (roll back, decode, draw) by the tokens it decodes: what one more token
    adds to a decode, which decides whether a second round rides along (with_riders).

    Kept as the target keeps its verify costs (duo.costs.StepCosts): measured, interpolated between
    measured sizes, and optimistic beyond them, so a size never timed is tried and one slow round does not
    keep riders out for good (catch-up after commits times the sizes again)."""

    costs: StepCosts = field(default_factory=StepCosts)

    def observe(self, tokens: int, seconds: float) -> None:
        if 0 < tokens <= MAX_TIMED_TOKENS:
            self.costs.observe(tokens, seconds)

    def extra(self, tokens: int) -> float:
        """How much longer a decode of tokens + 1 takes than one of `tokens`, as a fraction of the latter.

        with_riders counts a work as one token; a work that also catches up after a commit decodes more,
        so the ratio read is of slightly smaller decodes than the real ones: a little dearer per token
        (decodes flatten as they grow), which errs towards fewer riders."""
        return max(self.costs.batch_seconds(tokens + 1) / self.costs.batch_seconds(tokens) - 1.0, 0.0)


def confidence(doubt: Doubt) -> float:
    """The top token's share of the top two, sigmoid(margin): the draft's chance of being right if only
    its two best tokens could win (an upper bound on its top-1 probability, without a softmax)."""
    return 1.0 / (1.0 + math.exp(-min(doubt.margin, 50.0)))


@dataclass(frozen=True)
class Round:
    """A round a session offers a decode: the chain's lead (fork None), or a branch at `fork`, `growing` or new."""

    value: float
    fork: int | None = None
    growing: Branch | None = None


@dataclass(frozen=True)
class Horizon:
    """What the draft may do for a session now: the chain can grow (not paused, under max_ahead and the
    context), forks may start at chain positions below `fork_limit` (the KV cache holds their prefix),
    branches are at most `branch_cap` tokens past the assumed one, and `new_branches` more may start."""

    chain_open: bool
    fork_limit: int
    branch_cap: int
    new_branches: int


def ranked_rounds(committed: int, chain_len: int, doubts: dict[int, Doubt], branches: list[Branch],
                  horizon: Horizon, calibration: Calibration) -> list[Round]:
    """What a session offers the next decode, worth most first: the chain's lead and the best branch round
    (either may be missing). The first is drafted; the second only where it pays (with_riders)."""
    offered = [round_ for round_ in _candidates(committed, chain_len, doubts, branches, horizon, calibration)
               if round_ is not None]
    return sorted(offered, key=lambda round_: -round_.value)


def with_riders(offers: list[list[Round]], cost: RoundCost) -> list[list[Round]]:
    """The rounds of one batched decode: each session's first, and the second ones that pay for the time
    they add.

    The chain and the branch live in sequences of their own, so one decode can grow both, and where
    reading the weights dominates, a decode of n + 1 tokens costs far less than n + 1 decodes of one
    (0.5B Q4_K_M on one Xeon core: 66 ms for one token, 80 for two, 102 for four). A decode of n tokens
    worth V in all commits V / T(n) tokens per second; one more worth v makes it (V + v) / T(n + 1), which
    is more when v >= V * (T(n + 1) / T(n) - 1) = V * cost.extra(n): the time a token adds delays every
    token of the decode, every session's. Riders are taken worth most first, so the first that does not
    pay ends the list."""
    chosen = [offer[:1] for offer in offers]
    tokens = sum(map(len, chosen))
    value = sum(round_.value for rounds in chosen for round_ in rounds)
    riders = sorted(((offer[1], i) for i, offer in enumerate(offers) if len(offer) > 1), key=lambda r: -r[0].value)
    for rider, i in riders:
        if rider.value < value * cost.extra(tokens):
            break
        chosen[i].append(rider)
        tokens, value = tokens + 1, value + rider.value
    return chosen


def _candidates(committed: int, chain_len: int, doubts: dict[int, Doubt], branches: list[Branch],
                horizon: Horizon, calibration: Calibration) -> tuple[Round | None, Round | None]:
    """The chain's lead (None when it may not grow) and the branch round worth most (None when none is
    worth MIN_VALUE): the growing branch's next token, or a new fork's first."""
    survive = [1.0]  # survive[d] = S_d: drafts at depths 1..d all accepted
    for position in range(committed, chain_len):
        survive.append(survive[-1] * calibration.acceptance_at(doubts.get(position)))
    unknown = calibration.acceptance.value  # a token not drafted yet: no confidence to scale
    hit = calibration.alternative.value
    lead = Round(survive[-1] * unknown) if horizon.chain_open else None
    candidates = []
    growing = next((branch for branch in branches if not branch.finished), None)
    if growing is not None and len(growing.tokens) - 1 < horizon.branch_cap:
        used = _branch_used(survive, committed, growing.fork, doubts, hit, calibration)
        for doubt in growing.doubts[1:]:
            used *= calibration.acceptance_at(doubt)
        candidates.append(Round(used * unknown, growing.fork, growing))
    if horizon.new_branches > 0 and horizon.branch_cap > 0:
        taken = {branch.fork for branch in branches}
        for position in range(committed, min(horizon.fork_limit, chain_len)):
            doubt = doubts.get(position)
            if position in taken or doubt is None or doubt.alternative is None:
                continue
            used = _branch_used(survive, committed, position, doubts, hit, calibration)
            candidates.append(Round(used * unknown, position))
    branch = max(candidates, key=lambda round_: round_.value, default=None)
    return lead, branch if branch is not None and branch.value >= MIN_VALUE else None


def _branch_used(survive: list[float], committed: int, fork: int, doubts: dict[int, Doubt], hit: float,
                 calibration: Calibration) -> float:
    """The chance that a branch forking at `fork` is the target's chain: the drafts before it accepted,
    the one at the fork rejected, the alternative committed there."""
    return survive[fork - committed] * (1.0 - calibration.acceptance_at(doubts.get(fork))) * hit
