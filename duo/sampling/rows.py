"""The one row pipeline: what both sides do to a block of logits rows before a distribution is taken of each."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from duo.sampling.ops.penalties import OutputCounts, Penalties


def transform(penalties: Penalties, rows: np.ndarray, committed: Sequence[int], drafts: Sequence[int],
              counted: OutputCounts | None, masks: Sequence[np.ndarray] | None = None) -> None:
    """Transform `rows` [r, n_vocab] in place, as the request asks, before each row's distribution is taken.

    Both the target's verify (duo.target.batching: r = the drafts verified + 1) and the draft's draw (duo.draft.session:
    r = 1) call this one function: speculation is exact only if the draft's q and the target's p at a position come
    from the same row, so the rows are made in one place, not in two copies kept equal by hand.

    Row i scores the position after committed + drafts[:len(drafts) + 1 - r + i] (the last r values of j in
    committed + drafts[:j]). `committed`: the prompt and the committed output, whose output tokens `counted` holds (None:
    no output counted yet). `masks`: the grammar's allowed tokens [n_vocab] bool after each row's tokens, computed
    off this thread by the caller (sampling stays free of llguidance); None: no grammar; fewer masks than rows: the
    rows past them follow a drafted end of generation and are never committed.

    In order, as llama.cpp's sampler chain runs them (ops.penalties, ops.dry):
      1. logit bias: each biased token's logit plus its bias (-inf bans it)
      2. repeat penalty: a logit of a token among the last repeat_last_n divided by it where positive, else multiplied
      3. presence and frequency penalties: minus presence once and frequency per occurrence, over the output
      4. DRY: minus its penalty on each token that would extend a repetition of the context (prompt included)
      5. grammar mask: every token the grammar forbids after the row's tokens at -inf
    Then, row by row, duo.sampling.distributions.distribution (the target's in duo.sampling.verification, the draft's
    in duo.draft.session.draw), in the request's order (SamplingParams.order; greedy: the top token; mirostat:
    temperature, then mirostat alone), by default llama.cpp's:
      6. top-n-sigma  7. top-k  8. typical  9. top-p  10. min-p  11. xtc  12. temperature (dynatemp)  13. infill
    A committed token's logprobs are read from its row after step 5 (the target's, duo.target.batching).
    """
    if penalties.active:
        penalize_rows(penalties, rows, committed, drafts, counted)
    if masks is not None:
        mask_rows(rows, masks)


def penalize_rows(penalties: Penalties, rows: np.ndarray, committed: Sequence[int], drafts: Sequence[int],
                  counted: OutputCounts | None) -> None:
    """Steps 1-4 of `transform`: each row after the committed tokens and the drafts before it."""
    first = len(drafts) + 1 - len(rows)
    window = penalties.dry.window(committed) if penalties.dry.active else None
    for i, row in enumerate(rows):
        before = drafts[:first + i]
        penalties.apply(row, before, counted)
        if window is not None:
            penalties.dry.apply(row, np.concatenate([window, np.asarray(before, dtype=np.int64)]))


def mask_rows(rows: np.ndarray, masks: Sequence[np.ndarray]) -> None:
    """Step 5 of `transform`: a -inf logit has probability 0 in every distribution taken of its row, so each row's
    distribution becomes the grammar's constrained one."""
    for row, allowed in zip(rows, masks):
        row[~allowed] = -np.inf
