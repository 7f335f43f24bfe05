"""Greedy (and coupled-sampling) equality "up to floating-point near-ties", for tests of concurrent requests.

Requests decoded in one batched call share the attention's kernels with each other's tokens, which
changes the rounding of their logits: on the tiny random-weight models (logits up to about 50) the
drift reaches about 1e-3 over 16 tokens, and their greedy paths hold near-ties as close as 4e-4.
Where the target's two best tokens are that close, its greedy choice may legitimately differ from
run to run. So a concurrent answer must follow the target's own greedy path (decoded here, alone)
token for token, and may leave it only where the path's two best logits were within NEAR_TIE. Past such
a place the answer's own prefix is the path: the check goes on from there to the answer's end, and an
answer shorter than asked passes only where the target may end (its choice, or a near-tie, is EOS).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from duo.constraint import Cursor
from duo.llama.model import Model
from duo.sampling.coupled import coupled_ranking
from duo.sampling.distributions import distribution
from duo.sampling.params import SamplingParams

NEAR_TIE = 0.01  # logits: ten times the drift batching was seen to cause

# The target's choice from a position's logits: its token, and the other tokens an answer may take there
# (those within a near-tie of it), by the position's logits and absolute position.
Choice = Callable[[np.ndarray, int], tuple[int, list[int]]]


def leaves_greedy_path_only_at_a_near_tie(model: Model, prompt: str | list[int], got: list[int] | str,
                                          n_tokens: int) -> bool:
    """Whether `got` (token ids, or text) is the target's own greedy continuation of `prompt` (text, or
    token ids), of n_tokens tokens or ending where the target may end, but for tokens taken where the
    best two logits were within NEAR_TIE."""
    def greedy(logits: np.ndarray, position: int) -> tuple[int, list[int]]:
        best = int(np.argmax(logits))
        close = np.flatnonzero(logits >= logits[best] - NEAR_TIE)
        return best, [int(token) for token in close if token != best]

    return _follows_path_but_at_near_ties(model, prompt, got, n_tokens, greedy)


def leaves_coupled_path_only_at_a_near_tie(model: Model, prompt: str | list[int], got: list[int] | str,
                                           n_tokens: int, params: SamplingParams, seed: int) -> bool:
    """Whether `got` (token ids, or text) is the target's own coupled samples for `seed` (decoded here,
    alone), but for the runner-up taken where the exponential race's two best keys (log p + noise, so a
    logit's rounding moves them by it over the temperature) were within NEAR_TIE / temperature."""
    def coupled(logits: np.ndarray, position: int) -> tuple[int, list[int]]:
        ids, keys = coupled_ranking(distribution(logits, params), seed, position, n=2)
        near_tie = len(ids) > 1 and bool(keys[0] - keys[1] < NEAR_TIE / params.temperature)
        return int(ids[0]), [int(ids[1])] if near_tie else []

    return _follows_path_but_at_near_ties(model, prompt, got, n_tokens, coupled)


def _follows_path_but_at_near_ties(model: Model, prompt: str | list[int], got: list[int] | str, n_tokens: int,
                                   choose: Choice) -> bool:
    """Walk `got` token by token from `prompt` (decoded here, alone): each token must be `choose`'s, or one
    of the near-ties it allows; the walk goes on from the answer's own token either way (a near-tie taken
    early changes what follows, legitimately). Text is matched piece by piece. The answer must hold
    n_tokens tokens, or end where the target's choice (or a near-tie) is the end of generation."""
    tokens = model.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    context = model.new_context(len(tokens) + n_tokens + 1)
    wanted = got.encode() if isinstance(got, str) else None
    text = b""
    try:
        logits = context.decode(tokens, 0)[-1]
        for i in range(n_tokens):
            best, near = choose(logits, len(tokens) + i)
            allowed = [best, *near]
            may_end = any(model.is_end_of_generation(token) for token in allowed)
            if (len(got) == i) if wanted is None else (text == wanted):
                return may_end  # the answer ended before n_tokens: only where the target may end
            if wanted is None:
                token = got[i]
                if token not in allowed:
                    return False
                if model.is_end_of_generation(token):
                    return i == len(got) - 1
            else:  # the allowed token (the target's own first) whose text the answer goes on with
                token = next((t for t in allowed if not model.is_end_of_generation(t)
                              and wanted.startswith(text + model.token_piece(t))), None)
                if token is None:
                    return False
                text += model.token_piece(token)
            logits = context.decode([token], context.n_past)[-1]
        return len(got) == n_tokens if wanted is None else text == wanted
    finally:
        context.close()


def leaves_transformed_greedy_path_only_at_a_near_tie(model: Model, prompt: list[int], got: list[int], n_tokens: int,
                                                      transform: Callable[[np.ndarray, list[int]], np.ndarray]) -> bool:
    """leaves_greedy_path_only_at_a_near_tie where each position's logits are first transformed, after the answer's
    own tokens before it (a grammar's mask, penalties), as the target transforms what it verifies."""
    def greedy(logits: np.ndarray, position: int) -> tuple[int, list[int]]:
        row = transform(logits.copy(), got[:position - len(prompt)])
        best = int(np.argmax(row))
        close = np.flatnonzero(row >= row[best] - NEAR_TIE)
        return best, [int(token) for token in close if token != best]

    return _follows_path_but_at_near_ties(model, prompt, got, n_tokens, greedy)


def leaves_constrained_greedy_path_only_at_a_near_tie(model: Model, prompt: list[int], got: list[int], n_tokens: int,
                                                      cursor: Cursor) -> bool:
    """... under a grammar: each position masked by `cursor` after the answer's tokens before it (duo.constraint)."""
    def masked(row: np.ndarray, output: list[int]) -> np.ndarray:
        cursor.move_to(output)
        return cursor.mask(row)

    return leaves_transformed_greedy_path_only_at_a_near_tie(model, prompt, got, n_tokens, masked)
