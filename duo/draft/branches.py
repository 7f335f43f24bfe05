"""The draft's branches: continuations it drafts in spare time for the likely outcomes of a verification.

When the target rejects the draft's token at position p, it commits its own token there, and the
draft's chain beyond p is worthless: the target's next step would find no drafts and decode alone
while the draft learns of the commit and drafts again. A branch is prepared before that happens: at
a position where the draft was unsure, it assumes the target picks the draft's next-best token
instead and drafts a few tokens after it. If the target commits exactly that token, the branch
becomes the chain on both sides and its drafts are verified in the very next step.

Lossless: a branch's first token is never verified, only matched against what the target commits;
every token after it is verified like a chain token, with the distribution it was really drawn
from. Which branches exist depends on the draft's logits and its own random numbers only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from duo.sampling.distributions import SparseDist

@dataclass(frozen=True)
class Doubt:
    """How sure the draft was at one chain position, and what it would have picked otherwise."""

    margin: float             # how far its best logit leads the next: small where a rejection is likely
    alternative: int | None   # the most likely token other than the chain's (None: the draft allowed no other)
    dist: SparseDist | None   # what the chain's token was drawn from (None for greedy sessions)


def doubt_of(logits: np.ndarray, drawn: int, dist: SparseDist, greedy: bool) -> Doubt:
    """The Doubt of a position whose logits gave the chain token `drawn`, sampled from `dist`.

    Greedy: the alternative is the second-highest logit, the target's likely argmax when it
    disagrees. Sampled: the most probable other token the draft could have drawn (the target's
    recovered token comes from max(0, p - q), which favours tokens the draft underweights, but the
    draft's next-best is its best guess without p). The margin between the two best logits ranks
    positions by doubt as the top-1 probability would, at a tenth of the cost of a softmax over the
    vocabulary (two argmax passes): it runs on every drafted token.
    """
    first = int(np.argmax(logits))
    rest = logits.copy()
    rest[first] = -np.inf
    second = int(np.argmax(rest))
    margin = float(logits[first] - logits[second])
    if greedy:
        # Under a grammar (duo.constraint) the runner-up may be masked away: then there is no other token.
        alternative = (second if np.isfinite(logits[second]) else None) if first == drawn else first
        return Doubt(margin, alternative, None)
    others = (dist.ids != drawn) & (dist.probs > 0)
    alternative = int(dist.ids[others][np.argmax(dist.probs[others])]) if others.any() else None
    return Doubt(margin, alternative, dist)


@dataclass
class Branch:
    """A continuation forking from the chain at `fork`, sent to the target under its own epoch."""

    epoch: int
    fork: int                       # the position of its first token, the one it assumes the target commits
    tokens: list[int]               # [the assumed token, then the drafted ones]
    doubts: list[Doubt | None]      # per token (the assumed token's: None)
    finished: bool = False          # long enough, or it drafted an end of generation

    @property
    def end(self) -> int:
        return self.fork + len(self.tokens)


def preferred_draft_len(max_ahead: int) -> int:
    """The draft length k the target's policy prefers: it steers max_ahead to 2k + 2 (0: the draft rests)."""
    return max(1, (max_ahead - 2) // 2) if max_ahead > 0 else 0


def branch_length(max_ahead: int, fixed: int) -> int:
    """The most tokens to draft after a branch's assumed token: `fixed`, or by default the draft length k
    the target prefers: a hit's branch serves the step after the rejection, which verifies at most k.
    Whether a branch grows that long is duo.draft.value's to say: its later tokens are worth less.
    """
    if fixed:
        return fixed
    return preferred_draft_len(max_ahead)
