"""Lookup drafts by hand: dense rows and the catch-ups a lookup proposes."""

from __future__ import annotations

import threading

import numpy as np

from duo.lookup import ContextLookup
from duo.sampling.distributions import SparseDist


def catch_ups(monkeypatch) -> list[tuple[bool, int]]:
    """Every ContextLookup catch-up from now on: whether it ran on this thread (the event loop's under asyncio.run),
    and how many tokens it indexed."""
    seen: list[tuple[bool, int]] = []
    loop_thread = threading.get_ident()
    catch_up = ContextLookup._catch_up

    def recording(self: ContextLookup) -> None:
        seen.append((threading.get_ident() == loop_thread, len(self.tokens) - self.indexed))
        catch_up(self)

    monkeypatch.setattr(ContextLookup, "_catch_up", recording)
    return seen


def dense(dist: SparseDist, n_vocab: int) -> np.ndarray:
    probs = np.zeros(n_vocab)
    probs[dist.ids] = dist.probs
    return probs
