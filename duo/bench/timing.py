"""The bench's timings of the models themselves: T(n), a verify batch of n tokens, and S(m), m sequences in one call."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

from duo.llama.model import Model
from duo.llama.context import Part

COST_PREFIX = "def snake_game():\n" + "    x = step(x)\n" * 40  # cut to 200 tokens
COST_BATCH = " score = score + 1 if food == head else score"


@contextlib.contextmanager
def pinned(cores: set[int]) -> Iterator[None]:
    """This process on `cores` only, for the duration."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def batch_tokens(model: Model, n: int) -> list[int]:
    """`n` tokens of plausible code for a verify batch: COST_BATCH repeated as far as needed (it is 12 tokens;
    cut short, T(n) past 12 would silently time 12)."""
    tokens = model.tokenize(COST_BATCH)
    return (tokens * (n // len(tokens) + 1))[:n]


def measure_verify_costs(target: Path, cores: set[int], max_batch: int, reps: int) -> dict[int, float]:
    """T(n): median seconds to decode a batch of n tokens after a 200-token prefix, on `cores`."""
    with pinned(cores):
        model = Model(target, device="cpu", threads=len(cores))
        context = model.new_context(1024)
        prefix = model.tokenize(COST_PREFIX)[:200]
        context.decode(prefix, 0, logits_for=[])
        batch = batch_tokens(model, max_batch)
        costs = {}
        for n in range(1, max_batch + 1):
            times = []
            for _ in range(reps):
                began = time.perf_counter()
                context.decode(batch[:n], len(prefix), logits_for=range(n))
                times.append(time.perf_counter() - began)
                context.rollback(len(prefix))
            costs[n] = statistics.median(times)
        context.close()
        model.close()
        return costs


def measure_sequence_costs(target: Path, cores: set[int], counts: list[int], reps: int) -> dict[int, float]:
    """S(m): median seconds to decode one token for each of m sequences in one call, on `cores`, each
    sequence after the same 200-token prefix (forked from the first: shared cells; what is measured is
    reading the weights once for m tokens)."""
    with pinned(cores):
        model = Model(target, device="cpu", threads=len(cores))
        context = model.new_context(1024, n_seq=max(counts))
        prefix = model.tokenize(COST_PREFIX)[:200]
        context.decode(prefix, 0, logits_for=[])
        for seq in range(1, max(counts)):
            context.fork(seq, len(prefix))
        token = model.tokenize(COST_BATCH)[0]
        costs = {}
        for m in counts:
            times = []
            for _ in range(reps):
                began = time.perf_counter()
                context.decode_parts([Part(seq, len(prefix), [token]) for seq in range(m)])
                times.append(time.perf_counter() - began)
                for seq in range(m):
                    context.rollback(len(prefix), seq)
            costs[m] = statistics.median(times)
        context.close()
        model.close()
        return costs
