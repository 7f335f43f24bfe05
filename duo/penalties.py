"""Logit transforms before sampling: OpenAI's presence and frequency penalties and logit_bias, llama.cpp's repeat
penalty. Each row's transform depends on the output before it, so under speculation a verified row is transformed
with the committed output plus the drafts before that row (and the draft transforms what it drafts from the same
way): the target's distribution at every position is exactly the one it would sample alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

MAX_BIAS = 100.0  # OpenAI's range for logit_bias values; -inf (llama.cpp's `false`) bans a token


@dataclass(frozen=True)
class Penalties:
    """What a request's output so far does to the next logits. Order as llama.cpp's sampler chain: the biases,
    then the repeat penalty, then presence and frequency."""

    presence: float = 0.0    # subtracted once from every token the output holds (OpenAI: -2 to 2)
    frequency: float = 0.0   # subtracted once per time the output holds it (OpenAI: -2 to 2)
    repeat: float = 1.0      # llama.cpp: a logit of a token among the last `repeat_last_n` is divided by it where
    repeat_last_n: int = 64  # positive, multiplied where not (-1: the whole output, 0: off)
    bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.bias or (self.repeat != 1.0 and self.repeat_last_n))

    def validate(self, n_vocab: int) -> None:
        """ValueError naming the field and its range."""
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be between -2 and 2, got {value!r}")
        if not (math.isfinite(self.repeat) and 0.0 < self.repeat <= 10.0):
            raise ValueError(f"repeat_penalty must be in (0, 10] (1 = off), got {self.repeat!r}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be -1 (the whole output), 0 (off) or more, got {self.repeat_last_n}")
        for token, value in self.bias:
            if not 0 <= token < n_vocab:
                raise ValueError(f"logit_bias names token {token}, outside the vocabulary of {n_vocab}")
            if not (value == -math.inf or -MAX_BIAS <= value <= MAX_BIAS):
                raise ValueError(f"logit_bias values must be between -100 and 100 (or false: never), got {value!r}")

    def apply(self, logits: np.ndarray, output: Sequence[int]) -> np.ndarray:
        """`logits` (one row, changed in place and returned) after `output`, the tokens generated before it."""
        if self.bias:
            ids, values = zip(*self.bias)
            logits[list(ids)] += np.asarray(values, dtype=logits.dtype)
        if self.repeat != 1.0 and self.repeat_last_n and output:
            window = np.unique(np.asarray(output[-self.repeat_last_n:] if self.repeat_last_n > 0 else output))
            seen = logits[window]
            logits[window] = np.where(seen > 0, seen / self.repeat, seen * self.repeat)
        if (self.presence or self.frequency) and output:
            ids, counts = np.unique(np.asarray(output), return_counts=True)
            logits[ids] -= (self.presence + self.frequency * counts).astype(logits.dtype)
        return logits


def penalize_rows(penalties: Penalties, output: Sequence[int], drafts: Sequence[int], rows: np.ndarray) -> None:
    """Transform verification rows in place: row i follows output + drafts[:i]."""
    for i, row in enumerate(rows):
        penalties.apply(row, [*output, *drafts[:i]])
