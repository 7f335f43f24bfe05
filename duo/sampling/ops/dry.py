"""llama.cpp's DRY ("don't repeat yourself", from koboldcpp): a logit penalty on the tokens that would extend a
repetition of what the context already holds.

For each earlier position i of the context c (the last penalty_last_n tokens before the row, prompt included, as
llama-server feeds its sampler the prompt), let L_i be the length of the longest suffix of c that also ends at i,
at most the tokens since the last sequence breaker. The token c[i + 1] would extend that repetition; a token's
length L is the largest L_i among its places, and where L >= allowed_length its logit loses
  multiplier * base^(L - allowed_length)
(the exponent capped so that the power stays within a float32), except for single-token sequence breakers.
Example: c = a b c c b c y a b c: the suffix "a b c" also ends at c[2], so c[3] = c would make a repetition of 4.

Sequence breakers are text: a token whose text holds one restarts the count after it; a token whose text ends with
the start of one does where the breaker's rest (tokenized, at most MAX_TAIL tokens) follows it (llama.cpp's
restart sequences, found once per vocabulary and breakers: restart_sequences).
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

DEFAULT_BREAKERS = ("\n", ":", "\"", "*")  # llama-server's
MAX_BREAKER_BYTES = 40  # longer breakers are cut to this (llama.cpp's MAX_CHAR_LEN)
MAX_TAIL = 20           # tokens of a breaker's rest that must follow its head (llama.cpp's MAX_SEQ_LEN)
MAX_BREAKERS = 64       # a bound of duo's: each new list of breakers walks the vocabulary once
_FLOAT_MAX_LOG = 88.7228391  # ln of float32's largest value: base^exponent stays below it
_INT32_MAX = 2**31 - 1

Restarts = dict[int, tuple[tuple[int, ...], ...]]  # head token -> the tails that follow it (() for a whole breaker)


class DryVocab(Protocol):
    """What DRY reads of a model: its tokens' text and its tokenizer (duo.model.Model is one)."""

    @property
    def n_vocab(self) -> int: ...

    def token_piece(self, token: int, *, special: bool = False) -> bytes: ...

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class Dry:
    """A request's DRY settings (llama-server's names without dry_; its defaults) and its breakers' restart
    sequences for the vocabulary of the side that applies it (None until restart_sequences found them)."""

    multiplier: float = 0.0  # 0 = off
    base: float = 1.75
    allowed_length: int = 2
    penalty_last_n: int = -1  # -1: the whole context; 0: off
    breakers: tuple[str, ...] = DEFAULT_BREAKERS
    restarts: Restarts | None = None

    @property
    def active(self) -> bool:
        """llama.cpp's condition: a multiplier, a base of at least 1 and a window."""
        return self.multiplier != 0 and self.base >= 1 and self.penalty_last_n != 0

    def validate(self) -> None:
        """ValueError naming the field and its range."""
        if not (math.isfinite(self.multiplier) and 0 <= self.multiplier <= 1e6):
            raise ValueError(f"dry_multiplier must be between 0 (off) and 1e6, got {self.multiplier!r}")
        if not (math.isfinite(self.base) and 0 <= self.base <= 1e6):
            raise ValueError(f"dry_base must be between 1 and 1e6 (below 1: off), got {self.base!r}")
        if not 0 <= self.allowed_length <= _INT32_MAX:
            raise ValueError(f"dry_allowed_length must be between 0 and {_INT32_MAX}, got {self.allowed_length}")
        if not -1 <= self.penalty_last_n <= _INT32_MAX:
            raise ValueError(f"dry_penalty_last_n must be -1 (the whole context), 0 (off) or up to {_INT32_MAX}, "
                             f"got {self.penalty_last_n}")
        if len(self.breakers) > MAX_BREAKERS:
            raise ValueError(f"dry_sequence_breakers holds {len(self.breakers)} strings, more than {MAX_BREAKERS}")

    def window(self, tokens: Sequence[int]) -> np.ndarray:
        """The context DRY reads of `tokens` (those before a row): the last penalty_last_n of them, as int64."""
        n = self.penalty_last_n
        return np.asarray(tokens[-n:] if n > 0 else tokens, dtype=np.int64)

    def apply(self, logits: np.ndarray, context: np.ndarray) -> None:
        """Lower `logits` (one row, in place) by the penalty of each token that would extend a repetition of
        `context` (the tokens before the row, oldest first)."""
        if self.penalty_last_n > 0:
            context = context[-self.penalty_last_n:]
        ids, lengths = self._repeat_lengths(context)
        if not ids.size:
            return
        exponent = lengths - self.allowed_length
        if self.base > 1.000001:  # llama.cpp's cap: base^cap stays within a float32
            exponent = np.minimum(exponent, int(_FLOAT_MAX_LOG / math.log(self.base)))
        logits[ids] -= (self.multiplier * np.power(float(self.base), exponent)).astype(logits.dtype)

    def _repeat_lengths(self, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens a repetition of length >= allowed_length would continue, and that length L (the module's)."""
        none = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        n = c.size
        limit = self._limit(c)
        if n <= self.allowed_length or limit < self.allowed_length:
            return none
        ends = np.flatnonzero(c[:-1] == c[-1])  # where a suffix of c can end again
        lengths = np.ones(ends.size, dtype=np.int64)
        alive = np.arange(ends.size)
        for j in range(1, limit):  # extend each match backwards, all at once
            at = ends[alive] - j
            same = at >= 0
            same[same] = c[at[same]] == c[n - 1 - j]
            alive = alive[same]
            if not alive.size:
                break
            lengths[alive] += 1
        lengths = np.minimum(lengths, limit)
        if self.allowed_length == 0:  # every later token of the window continues a repetition of length 0
            ends = np.concatenate([np.arange(n - 1), ends])
            lengths = np.concatenate([np.zeros(n - 1, dtype=np.int64), lengths])
        kept = lengths >= self.allowed_length
        tokens, lengths = c[ends[kept] + 1], lengths[kept]
        ids, first = np.unique(tokens, return_inverse=True)
        longest = np.zeros(ids.size, dtype=np.int64)
        np.maximum.at(longest, first, lengths)
        breaks = np.fromiter((() in (self.restarts or {}).get(int(t), ()) for t in ids), dtype=bool, count=ids.size)
        return ids[~breaks], longest[~breaks]

    def _limit(self, c: np.ndarray) -> int:
        """How long a repetition may be: the tokens after the latest restart sequence (a breaker), or all of c."""
        restarts = self.restarts or {}
        if not restarts:
            return c.size
        heads = np.flatnonzero(np.isin(c, np.fromiter(restarts, dtype=np.int64, count=len(restarts))))
        for at in heads[::-1]:  # the latest head first
            after = c.size - 1 - int(at)  # tokens after the head
            tails = [tail for tail in restarts[int(c[at])] if len(tail) <= after
                     and tuple(c[at + 1:at + 1 + len(tail)].tolist()) == tail]
            if tails:
                return after - max(len(tail) for tail in tails)
        return c.size


_pieces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> every token's text
_restarts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {breakers: Restarts}, LRU
MAX_KNOWN_BREAKER_LISTS = 16  # lists of breakers whose restart sequences are kept per model


def restart_sequences(vocab: DryVocab, breakers: Sequence[str]) -> Restarts:
    """llama.cpp's restart sequences of `breakers` in `vocab`: each token whose text (special tokens rendered) holds
    a breaker is a head with the empty tail; a token whose text ends with a breaker's first bytes is a head whose
    tail is the rest of the breaker, tokenized. Walks the vocabulary: built once per model and list of breakers."""
    known = _restarts.setdefault(vocab, OrderedDict())
    key = tuple(breakers)
    if key in known:
        known.move_to_end(key)
    else:
        if vocab not in _pieces:
            _pieces[vocab] = [vocab.token_piece(token, special=True) for token in range(vocab.n_vocab)]
        found: dict[int, list[tuple[int, ...]]] = {}
        for breaker in key:
            _add_breaker(vocab, _pieces[vocab], breaker.encode()[:MAX_BREAKER_BYTES], found)
        known[key] = {head: tuple(tails) for head, tails in found.items()}
        if len(known) > MAX_KNOWN_BREAKER_LISTS:  # clients choose the lists: the least recently used goes
            known.popitem(last=False)
    return known[key]


def _add_breaker(vocab: DryVocab, pieces: list[bytes], breaker: bytes, found: dict[int, list[tuple[int, ...]]]) -> None:
    if not breaker:
        return  # llama.cpp skips an empty breaker
    for token, word in enumerate(pieces):
        if breaker in word:
            tails = [()]
        elif len(breaker) > 1 and breaker[:1] in word:
            tails = [_tail(vocab, breaker[len(word) - at:]) for at in range(len(word))
                     if breaker.startswith(word[at:])]
        else:
            continue
        for tail in tails:
            if tail not in found.setdefault(token, []):
                found[token].append(tail)


def _tail(vocab: DryVocab, rest: bytes) -> tuple[int, ...]:
    """The tokens of a breaker's rest, as llama.cpp tokenizes it (no special tokens), at most MAX_TAIL."""
    return tuple(vocab.tokenize(rest.decode(errors="ignore"), add_special=False, parse_special=False)[:MAX_TAIL])
