"""llama.cpp's DRY ("don't repeat yourself", from koboldcpp): a logit penalty on the tokens that would extend a
repetition of what the context already holds.

For each earlier position i of the context c (the last penalty_last_n tokens before the row, prompt included, as
llama-server feeds its sampler the prompt), let L_i be the length of the longest suffix of c that also ends at i,
at most the tokens since the last sequence breaker. The token c[i + 1] would extend that repetition; a token's
length L is the largest L_i among its places, and where L >= allowed_length its logit loses
  multiplier * base^(L - allowed_length)
(the exponent capped so that the power stays within a float32), except for single-token sequence breakers.
Example: c = a b c c b c y a b c: the suffix "a b c" also ends at c[2], so c[3] = c would make a repetition of 4.
Every L_i comes from one pass of the Z-algorithm over c reversed, as llama.cpp finds them: linear in the window.

Sequence breakers are text: a token whose text holds one restarts the count after it; a token whose text ends with
the start of one does where the breaker's rest (tokenized, at most MAX_TAIL tokens) follows it (llama.cpp's
restart sequences, found once per vocabulary and breakers: restart_sequences).
"""

from __future__ import annotations

import math
import threading
import weakref
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np

DEFAULT_BREAKERS = ("\n", ":", "\"", "*")  # llama-server's
MAX_BREAKER_BYTES = 40  # longer breakers are cut to this (llama.cpp's MAX_CHAR_LEN)
MAX_TAIL = 20           # tokens of a breaker's rest that must follow its head (llama.cpp's MAX_SEQ_LEN)
MAX_BREAKERS = 64       # a bound of duo's (llama-server takes any number): each new list is searched for
_FLOAT_MAX_LOG = 88.7228391  # ln of float32's largest value: base^exponent stays below it
_INT32_MAX = 2**31 - 1

Tail = tuple[int, ...]


class Restarts(dict[int, tuple[Tail, ...]]):
    """llama.cpp's restart sequences: head token -> the tails that follow it (() for a whole breaker), with the
    lookups each row reads them by (restart_sequences builds them off the model's thread, one per list of breakers
    and vocabulary; `of` indexes a plain dict). Read-only."""

    def __init__(self, sequences: Iterable[tuple[int, tuple[Tail, ...]]], singles: np.ndarray,
                 pair_codes: np.ndarray) -> None:
        super().__init__(sequences)
        self.singles = singles        # [k] sorted int64: the heads with the empty tail, which break alone
        self.pair_codes = pair_codes  # [k] sorted int64: each head and the first token of one of its tails (_pair_code)
        self._by_pair: dict[tuple[int, int], tuple[Tail, ...]] = {}  # (head, first) -> its tails that start so

    @staticmethod
    def of(sequences: dict[int, tuple[Tail, ...]]) -> Restarts:
        """`sequences` (head -> tails) with their lookups."""
        pairs = [(head, tail) for head, tails in sequences.items() for tail in tails]
        singles = np.unique(np.array([head for head, tail in pairs if not tail], dtype=np.int64))
        codes = np.unique(np.array([_pair_code(head, tail[0]) for head, tail in pairs if tail], dtype=np.int64))
        return Restarts(sequences.items(), singles, codes)

    def longest_tail(self, c: list[int], at: int) -> int | None:
        """The length of the longest tail of c[at] that follows it in c (0: a whole breaker), None where none does."""
        head = c[at]
        lengths = [0] if () in self.get(head, ()) else []
        if at + 1 < len(c):
            lengths += [len(tail) for tail in self._starting(head, c[at + 1])
                        if tuple(c[at + 1:at + 1 + len(tail)]) == tail]
        return max(lengths, default=None)

    def _starting(self, head: int, first: int) -> tuple[Tail, ...]:
        """The tails of `head` that start with `first`, picked once per pair (only the pairs contexts hold)."""
        if (head, first) not in self._by_pair:
            self._by_pair[head, first] = tuple(tail for tail in self.get(head, ()) if tail[:1] == (first,))
        return self._by_pair[head, first]


def _pair_code(head: np.ndarray | int, following: np.ndarray | int) -> np.ndarray | int:
    """One int64 for a pair of token ids (each below 2^31, an int32's)."""
    return head * 2**31 + following


def _in_sorted(values: np.ndarray, sorted_values: np.ndarray) -> np.ndarray:
    """[n] bool: which of `values` `sorted_values` holds (binary searches: n log k)."""
    if not sorted_values.size:
        return np.zeros(values.shape, dtype=bool)
    at = np.minimum(np.searchsorted(sorted_values, values), sorted_values.size - 1)
    return sorted_values[at] == values


class DryVocab(Protocol):
    """What DRY reads of a model: its tokens' text and its tokenizer (duo.llama.model.Model is one)."""

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

    @cached_property  # a frozen dataclass keeps it in its __dict__: built once per request
    def _sequences(self) -> Restarts:
        """The restart sequences with their lookups (restart_sequences builds them; a plain dict is indexed here)."""
        restarts = self.restarts
        return restarts if isinstance(restarts, Restarts) else Restarts.of(restarts or {})

    def _repeat_lengths(self, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens a repetition of length >= allowed_length would continue, and that length L (the module's)."""
        none = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        n = c.size
        limit = self._limit(c)
        if n <= self.allowed_length or limit < self.allowed_length:
            return none
        ends = np.flatnonzero(c[:-1] == c[-1])  # where a suffix of c can end again
        lengths = _common_suffixes(c, ends, limit)
        if self.allowed_length == 0:  # every later token of the window continues a repetition of length 0
            ends = np.concatenate([np.arange(n - 1), ends])
            lengths = np.concatenate([np.zeros(n - 1, dtype=np.int64), lengths])
        kept = lengths >= self.allowed_length
        tokens, lengths = c[ends[kept] + 1], lengths[kept]
        ids, first = np.unique(tokens, return_inverse=True)
        longest = np.zeros(ids.size, dtype=np.int64)
        np.maximum.at(longest, first, lengths)
        breaks = _in_sorted(ids, self._sequences.singles)
        return ids[~breaks], longest[~breaks]

    def _limit(self, c: np.ndarray) -> int:
        """How long a repetition may be: the tokens after the latest restart sequence (a breaker), or all of c.

        Linear in c: binary searches mark the tokens that break alone and the (head, next token) pairs that may start
        a longer restart sequence; only those are checked, the latest first, and a token that breaks alone ends it."""
        restarts, n = self._sequences, c.size
        if not restarts or not n:
            return n
        candidates = _in_sorted(c, restarts.singles)
        candidates[:-1] |= _in_sorted(_pair_code(c[:-1], c[1:]), restarts.pair_codes)
        tokens = c.tolist()
        for at in np.flatnonzero(candidates)[::-1].tolist():
            longest = restarts.longest_tail(tokens, at)
            if longest is not None:
                return n - 1 - at - longest
        return n


def _common_suffixes(c: np.ndarray, ends: np.ndarray, cap: int) -> np.ndarray:
    """[len(ends)] int64: for each position i of `ends` (ascending, each holding c's last token), the length of the
    longest suffix of c that also ends at i, at most `cap`.

    The Z-algorithm over r = c reversed (llama.cpp's, from koboldcpp): z[k] is the longest common prefix of r and
    r[k:], the suffix that also ends at i = n - 1 - k. The box [lt, rt] is the latest match r[lt..rt] = r[0..rt-lt]
    found; a k inside it reads z[k - lt] instead of comparing again, and comparisons only move rt forward: O(n) in
    all. Only the k with r[k] = r[0] are visited: elsewhere z is 0, and such a k would leave the box as it is. Every
    z is capped (capped values keep the box's reasoning: a z[k - lt] capped below the box's end gives z[k] = cap)."""
    n = c.size
    r = c[::-1].tolist()
    z = [0] * n
    lt = rt = 0
    for k in (n - 1 - ends[::-1]).tolist():
        if k <= rt and z[k - lt] < rt - k + 1:
            z[k] = z[k - lt]  # the match at k - lt ends inside the box: so does the one at k
            continue
        i, end = max(k, rt + 1), min(n, k + cap)  # r[k..rt] = r[0..rt-k] is known already
        while i < end and r[i] == r[i - k]:
            i += 1
        z[k] = i - k
        if i > k:
            lt, rt = k, i - 1
    return np.asarray(z, dtype=np.int64)[n - 1 - ends]


_texts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _VocabText
_restarts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {breakers: Restarts}, LRU
_lock = threading.Lock()  # the draft and the target look them up from threads of their own
MAX_KNOWN_BREAKER_LISTS = 16  # lists of breakers whose restart sequences are kept per model


def restart_sequences(vocab: DryVocab, breakers: Sequence[str]) -> Restarts:
    """llama.cpp's restart sequences of `breakers` in `vocab`: each token whose text (special tokens rendered) holds
    a breaker is a head with the empty tail; a token whose text ends with a breaker's first bytes is a head whose
    tail is the rest of the breaker, tokenized. The vocabulary's text is laid out once per model (_VocabText: a walk
    of every token); a new list of breakers is then found by searches over it, not a walk."""
    key = tuple(breakers)
    with _lock:
        known = _restarts.setdefault(vocab, OrderedDict())
        if key in known:
            known.move_to_end(key)
            return known[key]
        if vocab not in _texts:
            _texts[vocab] = _VocabText(vocab)
        known[key] = _restarts_of(vocab, _texts[vocab], [b.encode()[:MAX_BREAKER_BYTES] for b in key])
        if len(known) > MAX_KNOWN_BREAKER_LISTS:  # clients choose the lists: the least recently used goes
            known.popitem(last=False)
        return known[key]


class _VocabText:
    """Every token's text laid out for searching: one byte array with each token's span in it, and the tokens sorted
    by their text reversed, so that those ending with given bytes are one range of that order."""

    def __init__(self, vocab: DryVocab) -> None:
        pieces = [vocab.token_piece(token, special=True) for token in range(vocab.n_vocab)]
        lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        self.ends = np.cumsum(lengths)  # [n_vocab] where each token's text ends in `text`
        self.text = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        order = sorted(range(len(pieces)), key=lambda token: pieces[token][::-1])
        self.reversed = [pieces[token][::-1] for token in order]  # sorted
        self.by_reversed = np.array(order, dtype=np.int64)
        self.past_any = b"\xff" * (int(lengths.max(initial=0)) + 1)  # after the longest text: sorts after any

    def holding(self, breaker: bytes) -> np.ndarray:
        """The tokens whose text holds `breaker` (non-empty), sorted: its places in the text, first byte first,
        that lie within one token."""
        m = len(breaker)
        if m > self.text.size:
            return np.zeros(0, dtype=np.int64)
        at = np.flatnonzero(self.text[:self.text.size - m + 1] == breaker[0])
        for j in range(1, m):
            at = at[self.text[at + j] == breaker[j]]
        tokens = np.searchsorted(self.ends, at, side="right")  # the (non-empty) token whose text has byte `at`
        return np.unique(tokens[at + m <= self.ends[tokens]])

    def ending_with(self, start: bytes) -> np.ndarray:
        """The tokens whose text ends with `start` (non-empty): the texts reversed that begin with it reversed."""
        key = start[::-1]
        low = bisect_left(self.reversed, key)
        return self.by_reversed[low:bisect_left(self.reversed, key + self.past_any, low)]


def _restarts_of(vocab: DryVocab, text: _VocabText, breakers: list[bytes]) -> Restarts:
    """The restart sequences in llama.cpp's order: each head's tails by breaker, and within a breaker the empty
    tail (the text holds it) or else the longest start of the breaker first; each tail once."""
    heads: list[np.ndarray] = []  # heads[g]: the tokens whose tails include tails[g]; g is llama.cpp's order
    tails: list[Tail] = []
    for breaker in breakers:
        if not breaker:
            continue  # llama.cpp skips an empty breaker
        holding = text.holding(breaker)
        heads.append(holding)
        tails.append(())
        for k in range(len(breaker) - 1, 0, -1):  # a start of k bytes ends the token; the rest follows
            ending = text.ending_with(breaker[:k])
            ending = ending[~_in_sorted(ending, holding)]
            if ending.size:
                heads.append(ending)
                tails.append(_tail(vocab, breaker[k:]))
    if not heads:
        return Restarts.of({})
    ids = {tail: i for i, tail in enumerate(dict.fromkeys(tails))}  # each distinct tail's number
    distinct, tail_ids = list(ids), np.array([ids[tail] for tail in tails], dtype=np.int64)
    token = np.concatenate(heads)
    group = np.repeat(np.arange(len(heads)), [h.size for h in heads])
    order = np.lexsort((group, token))  # by token, then group: each head's tails in order
    token, tail = token[order], tail_ids[group[order]]
    once = np.sort(np.unique(token * len(distinct) + tail, return_index=True)[1])  # each tail once per head
    token, tail = token[once], tail[once]
    first = np.array([t[0] if t else -1 for t in distinct], dtype=np.int64)[tail]  # -1: the empty tail
    singles, codes = np.unique(token[first < 0]), np.unique(_pair_code(token[first >= 0], first[first >= 0]))
    starts = np.flatnonzero(np.diff(token, prepend=-1)).tolist() + [token.size]  # where each head's tails begin
    token, tail = token.tolist(), tail.tolist()
    return Restarts(((token[a], tuple(distinct[t] for t in tail[a:b])) for a, b in zip(starts, starts[1:])),
                    singles, codes)


def _tail(vocab: DryVocab, rest: bytes) -> Tail:
    """The tokens of a breaker's rest, as llama.cpp tokenizes it (no special tokens), at most MAX_TAIL."""
    return tuple(vocab.tokenize(rest.decode(errors="ignore"), add_special=False, parse_special=False)[:MAX_TAIL])
