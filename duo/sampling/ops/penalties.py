"""Logit transforms before sampling: OpenAI's presence and frequency penalties and logit_bias, llama.cpp's repeat
penalty and DRY (duo.sampling.ops.dry). Each row's transform depends on the tokens before it, so under speculation a
verified row is transformed with the committed tokens plus the drafts before that row, and the draft transforms what
it drafts from the same way (duo.sampling.rows): the target's distribution at every position is exactly the one
it would sample alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Iterable, Sequence

import numpy as np

from duo.sampling.ops.dry import Dry, DryVocab, restart_sequences

MAX_BIAS = 100.0  # OpenAI's range for logit_bias values; -inf (llama.cpp's `false`) bans a token
MAX_REPEAT_LAST_N = 2**31 - 1  # the wire's int32 (proto/duo.proto: SamplingParams.repeat_last_n)


def summed_biases(entries: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """Logit biases by token id, sorted, as llama.cpp applies a list of them: every entry adds its bias, so a token
    named twice gets the sum, held at no bound (as there: each entry is bounded by MAX_BIAS where the body is read,
    and sums of sums, ids first and then the texts' tokens, stay the one sum); a ban (-inf) stays one."""
    totals: dict[int, float] = {}
    for token, bias in entries:
        totals[token] = totals.get(token, 0.0) + bias
    return tuple(sorted(totals.items()))


class OutputCounts:
    """How often each token occurs in a request's committed output, kept up as tokens are committed (commits only
    append), so that a row's penalties cost one pass over the distinct tokens seen, not a sort of the whole output
    (9 rows after 32k tokens, one core: 0.7 ms, where np.unique of the output on every row took 10-20 ms)."""

    def __init__(self, n_vocab: int, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []                      # the output so far
        self.counts = np.zeros(n_vocab, dtype=np.int32)  # [n_vocab] occurrences of each token in it
        self.distinct = np.zeros(0, dtype=np.int64)      # [d] the ids with a count, in the order first seen
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        ids, counts = np.unique(np.asarray(tokens, dtype=np.int64), return_counts=True)
        self.distinct = np.concatenate([self.distinct, ids[self.counts[ids] == 0]])
        self.counts[ids] += counts.astype(np.int32)
        self.tokens.extend(tokens)


@dataclass(frozen=True)
class Penalties:
    """What a request's tokens so far do to the next logits. Order as llama.cpp's sampler chain: the biases,
    then the repeat penalty, then presence and frequency (over the output), then DRY (over the whole context)."""

    presence: float = 0.0    # subtracted once from every token the output holds (OpenAI: -2 to 2)
    frequency: float = 0.0   # subtracted once per time the output holds it (OpenAI: -2 to 2)
    repeat: float = 1.0      # llama.cpp: a logit of a token among the last `repeat_last_n` is divided by it where
    repeat_last_n: int = 64  # positive, multiplied where not (-1: the whole output, 0: off)
    bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    dry: Dry = Dry()

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.bias or (self.repeat != 1.0 and self.repeat_last_n)
                    or self.dry.active)

    @cached_property  # built once per request (a frozen dataclass keeps it in its __dict__): a row costs one add
    def _bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The bias as [n] int64 ids and [n] float64 values (only once validate found the ids in the vocabulary)."""
        ids = np.fromiter((token for token, _ in self.bias), dtype=np.int64, count=len(self.bias))
        values = np.fromiter((value for _, value in self.bias), dtype=np.float64, count=len(self.bias))
        return ids, values

    def for_vocab(self, vocab: DryVocab) -> Penalties:
        """These penalties with DRY's restart sequences found in `vocab`, the applying side's (the first time for a
        list of breakers, a walk of the vocabulary: call it off the event loop)."""
        if not self.dry.active or self.dry.restarts is not None:
            return self
        return replace(self, dry=replace(self.dry, restarts=restart_sequences(vocab, self.dry.breakers)))

    def validate(self, n_vocab: int) -> None:
        """ValueError naming the field and its range."""
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be between -2 and 2, got {value!r}")
        if not (math.isfinite(self.repeat) and 0.0 < self.repeat <= 10.0):
            raise ValueError(f"repeat_penalty must be in (0, 10] (1 = off), got {self.repeat!r}")
        if not -1 <= self.repeat_last_n <= MAX_REPEAT_LAST_N:
            raise ValueError(f"repeat_last_n must be -1 (the whole output), 0 (off) or up to {MAX_REPEAT_LAST_N}, "
                             f"got {self.repeat_last_n}")
        self._validate_bias(n_vocab)
        self.dry.validate()

    def _validate_bias(self, n_vocab: int) -> None:
        if len(self.bias) > n_vocab:
            raise ValueError(f"logit_bias has {len(self.bias)} entries, more than the vocabulary's {n_vocab} tokens")
        # Checked one by one before any array is built: an id may be past what int64 holds.
        outside = next((token for token, _ in self.bias if not 0 <= token < n_vocab), None)
        if outside is not None:
            raise ValueError(f"logit_bias names token {outside}, outside the vocabulary of {n_vocab}")
        ids, values = self._bias_arrays
        banned = values == -math.inf
        # A body's every entry is within ±MAX_BIAS (checked where it is read) and a token's entries add up
        # (summed_biases), so a sum may reach MAX_BIAS times the entries a body may hold, the vocabulary's size: still
        # far inside float32. NaN and +inf are wrong.
        wrong = ~(banned | (np.abs(values) <= MAX_BIAS * n_vocab))
        if wrong.any():
            raise ValueError(f"logit_bias values must be between -100 and 100 (or false: never), a token's entries "
                             f"summed; got {values[wrong][0]!r}")
        if np.unique(ids[banned]).size == n_vocab:
            raise ValueError("logit_bias bans every token of the vocabulary (false or -inf on all of them): "
                             "nothing could be generated")

    def apply(self, logits: np.ndarray, output: Sequence[int], counted: OutputCounts | None = None) -> np.ndarray:
        """`logits` (one row, changed in place and returned) after the tokens generated before it: the committed
        output that `counted` holds, if given, then `output`. DRY reads the whole context: duo.sampling.rows."""
        if self.bias:
            ids, values = self._bias_arrays
            logits[ids] += values.astype(logits.dtype)
        repeat = self.repeat != 1.0 and self.repeat_last_n
        if not (repeat or self.presence or self.frequency):
            return logits
        ids, counts = _distinct_counts(counted, output)
        if repeat:
            n = self.repeat_last_n
            before = counted.tokens[-n:] if counted is not None and n > 0 else []
            window = np.unique(np.asarray([*before, *output][-n:], dtype=np.int64)) if n > 0 else ids
            seen = logits[window]
            logits[window] = np.where(seen > 0, seen / self.repeat, seen * self.repeat)
        if self.presence or self.frequency:
            logits[ids] -= (self.presence + self.frequency * counts).astype(logits.dtype)
        return logits


def _distinct_counts(counted: OutputCounts | None, output: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The distinct tokens of the counted output followed by `output`, each once, and how often each occurs in all."""
    later, later_counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
    if counted is None:
        return later, later_counts
    earlier = counted.distinct[~np.isin(counted.distinct, later)]  # those only the counted output holds
    return (np.concatenate([earlier, later]),
            np.concatenate([counted.counts[earlier], later_counts + counted.counts[later]]))

