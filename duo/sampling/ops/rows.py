"""Where both sides transform a row's logits by the tokens before it (the penalties and DRY): the target each row it
verifies, the draft each row it draws from, with the same function."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from duo.sampling.ops.penalties import OutputCounts, Penalties


def penalize_rows(penalties: Penalties, rows: np.ndarray, committed: Sequence[int], drafts: Sequence[int],
                  counted: OutputCounts | None) -> None:
    """Transform `rows` [r, n_vocab] in place: they score the positions after committed + drafts[:j] for the last r
    values of j (0 .. len(drafts)), so row i follows committed + drafts[:len(drafts) + 1 - r + i]. `committed`: the
    prompt and the committed output, whose output tokens `counted` holds (None: no output counted yet). The target
    passes a verify step's rows (r = len(drafts) + 1), the draft the one row it draws from (r = 1)."""
    first = len(drafts) + 1 - len(rows)
    window = penalties.dry.window(committed) if penalties.dry.active else None
    for i, row in enumerate(rows):
        before = drafts[:first + i]
        penalties.apply(row, before, counted)
        if window is not None:
            penalties.dry.apply(row, np.concatenate([window, np.asarray(before, dtype=np.int64)]))
