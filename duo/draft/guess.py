"""Guessing the chain's next tokens from the context: the draft drafts what follows a lookup's guess in one decode.

Where the chain ends like an earlier n-gram of the context (duo.lookup), the tokens that followed it there are a
guess g_1..g_L of the chain's next ones. The draft decodes the guess with its chain's catch-up, in the same batch,
taking logits at every guessed position, and draws its own token at each of them in order: while its draw equals the
guess, the next row (computed as if the guess were right) is the right one to draw from; the first draw that
differs ends the round. So the chain is exactly the one the draft would draft token by token, each token drawn
from the q it declares (greedy: its argmax; residual: a sample of q; coupled: its race winner), and the target
verifies it as ever; only sooner, where the guess holds: a decode of L + 1 tokens costs far less than L + 1
decodes of one (0.5B Q4_K_M on one Xeon core: 1.67 T(1) for four).

A guess the draft's draws do not follow costs its rows for nothing, so its length is the one that commits the most
tokens per second: with a guess of L tokens a work draws 1 + m + m^2 + ... + m^L tokens on average (m: the chance
that a draw equals the guessed token, learnt from the rounds), and the round takes T(n + L) seconds, n its tokens
without the guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from duo.costs import MovingAverage
from duo.draft.value import RoundCost

# Guessed tokens per round at most: a longer guess is rarely followed to its end, and it holds the round's decode.
GUESS_MAX = 8
# Before any round judged a guess: lookup guesses of edited code are followed ~0.9, of new code ~0.4.
PRIOR_MATCH = 0.6


@dataclass
class GuessRate:
    """How often the draft's draw equals the guessed token: a session's own, starting from the drafter's (which
    every session's judgements teach), so that a session's first rounds guess as the last ones did."""

    shared: MovingAverage
    own: MovingAverage = field(init=False)

    def __post_init__(self) -> None:
        self.own = MovingAverage(self.shared.value, 1.0)

    def judge(self, kept: int, missed: bool) -> None:
        """A round's draws followed the guess for `kept` tokens, and then drew another token than it (`missed`) or
        stopped (the guess's end, a pause)."""
        judged = [1.0] * kept + ([0.0] if missed else [])
        for match in judged:
            self.own.add(match)
            self.shared.add(match)


def shared_guess_rate() -> MovingAverage:
    return MovingAverage(PRIOR_MATCH, 1.0)


def guess_length(match: float, cost: RoundCost, tokens: int, most: int) -> int:
    """The guess length L <= `most` that yields the most tokens per second of the round: its other works' draws
    (one each) and this one's 1 + m + ... + m^L over T(tokens + L), `tokens` the round's tokens without the guess
    (this work's own draw included). 0: guessing does not pay, the work draws its one token."""
    best, best_rate, expected, survive = 0, 0.0, float(tokens), 1.0
    for length in range(min(most, GUESS_MAX) + 1):
        if length:
            survive *= match
            expected += survive
        rate = expected / cost.costs.batch_seconds(tokens + length)
        if rate > best_rate:
            best, best_rate = length, rate
    return best
