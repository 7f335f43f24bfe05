"""Idle sequences' prefixes parked in host memory instead of the KV cache (llama-server's --cache-ram, with its
--cache-idle-slots on: the default).

Why: llama.cpp's unified KV cache attends over every cell up to the highest one in use, whichever sequence holds it;
the mask hides other sequences' cells from a token, but the kernel still reads them. A prefix kept for a
conversation's next turn thus makes every other request's tokens cost as if their context were that much longer: a
2,048-token prompt read in 0.13 s alone took 1.54 s beside another sequence's 12,000 cells (tiny model, one CPU
core; scripts/measure_idle_prefixes.py measures a real pair). Copied to host memory and cleared, the prefix costs
nothing while it waits, and a copy back (GB/s, against tokens/s for reading it again) when its conversation returns.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from duo.llama.context import Context, common_prefix_length
from duo.llama.errors import ModelError

log = logging.getLogger("duo.llama")

MIB = 1 << 20
DEFAULT_LIMIT_MIB = 8192  # llama-server's --cache-ram default
# The most prefixes kept, the oldest dropped first: each request's start compares its prompt with every one of them on
# the model thread, holding the GIL (a soak of short requests on a tiny model parks thousands within the byte limit).
MAX_PARKED = 128


@dataclass
class Parked:
    """A sequence's tokens and its cells' state (Context.saved), and what its owner keeps with them (the draft: the
    offset of the window they are a view of, duo.draft.window)."""

    tokens: list[int]
    state: ctypes.Array
    tag: int = 0

    @property
    def size(self) -> int:
        return len(self.state)


def parking_for(context: Context, limit_mib: int) -> Parking | None:
    """The parking of `context` as --cache-ram MIB asks: None for 0 (idle prefixes stay in the cache), no limit for
    a negative limit."""
    if limit_mib == 0:
        return None
    return Parking(context, None if limit_mib < 0 else limit_mib * MIB)


class Parking:
    """Prefixes of idle sequences of one context, in host memory, at most `limit_bytes` of them (None: no limit),
    the least recently parked or used dropped first."""

    def __init__(self, context: Context, limit_bytes: int | None = DEFAULT_LIMIT_MIB * MIB) -> None:
        self.context = context
        self.limit_bytes = limit_bytes
        self.entries: list[Parked] = []  # oldest first
        self.restored = 0  # prefixes put back into the cache, for the tests and the log

    @property
    def size(self) -> int:
        return sum(entry.size for entry in self.entries)

    def adopt(self, seq: int, tokens: Sequence[int], private: Collection[int] = (), tag: int = 0) -> int:
        """As Context.adopt_prefix, where a parked prefix may also give `seq` its start: the longest wins. A parked
        one goes back into the cache; it stays parked too unless `tokens` continue it whole (the sequence will hold
        more of the same conversation when it is parked again). What `seq` held and `tokens` do not continue (another
        conversation's cells, left for its next turn) is parked first, with `tag`, not thrown away."""
        held = self.context.held(seq)
        if seq not in private and common_prefix_length(held, tokens) < len(held):
            self._save(seq, tag)  # a copy: the shared part stays in the cells, for the adopt below to roll back to
        entry, n = self._best(tokens)
        if entry is not None and n > self.context.reusable(seq, tokens, private):
            self.entries.remove(entry)
            if self.context.restore(seq, entry.state, entry.tokens):
                self.restored += 1
                log.debug("sequence %d: %d of a parked prefix's %d tokens restored", seq, n, len(entry.tokens))
                self.context.rollback(n, seq)
                if n < len(entry.tokens):
                    self.entries.append(entry)  # used: the newest
                return n
            log.info("no run of %d free cells to restore a parked prefix into: reading its tokens again",
                     len(entry.tokens))
            self.entries.append(entry)
        return self.context.adopt_prefix(seq, tokens, private)

    def park(self, seqs: Iterable[int], private: Collection[int] = (), tags: Mapping[int, int] | None = None) -> None:
        """Copy each of `seqs` (idle: no request runs on it) to host memory with its tag, unless it is empty,
        `private` (its tokens are no other request's to share) or parked already; then clear it from the cache."""
        for seq in seqs:
            if seq not in private:
                self._save(seq, (tags or {}).get(seq, 0))
            self.context.clear(seq)

    def _save(self, seq: int, tag: int) -> None:
        """Keep a copy of what `seq` holds, unless it holds nothing or nothing new. Where that fails (no memory for
        the copy), the prefix is lost as though it were never parked, and the request that parks it goes on."""
        held = self.context.held(seq)
        if not held or self._holds(held):
            return
        try:
            self._keep(Parked(list(held), self.context.saved(seq), tag))
        except (MemoryError, ModelError) as error:
            log.warning("sequence %d's %d tokens not parked: %s", seq, len(held), error or "no memory for them")
            return
        log.debug("sequence %d idle: its %d tokens parked (%d prefixes, %.0f MiB)", seq, len(held),
                  len(self.entries), self.size / MIB)

    def _best(self, tokens: Sequence[int]) -> tuple[Parked | None, int]:
        """The parked prefix sharing the most leading tokens with `tokens`, and how many."""
        best, n = None, 0
        for entry in self.entries:
            shared = common_prefix_length(entry.tokens, tokens)
            if shared > n:
                best, n = entry, shared
        return best, n

    def _holds(self, tokens: Sequence[int]) -> bool:
        return any(common_prefix_length(entry.tokens, tokens) == len(tokens) for entry in self.entries)

    def _keep(self, entry: Parked) -> None:
        """Park `entry` in place of those it continues, dropping the oldest others until it fits the limit; one
        larger than the whole limit is not kept."""
        if self.limit_bytes is not None and entry.size > self.limit_bytes:
            log.info("a prefix of %d tokens (%.0f MiB) exceeds --cache-ram: not parked", len(entry.tokens),
                     entry.size / MIB)
            return
        self.entries = [old for old in self.entries
                        if common_prefix_length(old.tokens, entry.tokens) < len(old.tokens)]
        size = self.size  # summed once, not again for each one dropped
        while self.entries and (len(self.entries) >= MAX_PARKED or self.limit_bytes is not None
                                and size + entry.size > self.limit_bytes):
            size -= self.entries.pop(0).size
        self.entries.append(entry)
