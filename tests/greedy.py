"""Greedy (and coupled-sampling) equality "up to floating-point near-ties", for tests of concurrent requests.

Requests decoded in one batched call share the attention's kernels with each other's tokens, which
changes the rounding of their logits: on the tiny random-weight models (logits up to about 50) the
drift reaches about 1e-3 over 16 tokens, and their greedy paths hold near-ties as close as 4e-4.
Where the target's two best tokens are that close, its greedy choice may legitimately differ from
run to run. So a concurrent answer must follow the target's own greedy path (decoded here, alone)
token for token, and may leave it only where the path's two best logits were within NEAR_TIE.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from duo.model import Model
from duo.sampling import SamplingParams, coupled_ranking, distribution

NEAR_TIE = 0.01  # logits: ten times the drift batching was seen to cause

# The target's choice from a position's logits: (its token, whether an answer may leave it there for
# the given token, or for text (None) for whichever token the text continues with).
Choice = Callable[[np.ndarray, int], tuple[int, Callable[[int | None], bool]]]


def leaves_greedy_path_only_at_a_near_tie(model: Model, prompt: str | list[int], got: list[int] | str,
                                          n_tokens: int) -> bool:
    """Whether `got` (token ids, or text) follows the target's own greedy continuation of `prompt` (text,
    or token ids) until it ends or leaves it where the best two logits were within NEAR_TIE."""
    def greedy(logits: np.ndarray, position: int) -> tuple[int, Callable[[int | None], bool]]:
        best = int(np.argmax(logits))

        def may_leave(token: int | None) -> bool:
            other = np.partition(logits, -2)[-2] if token is None else logits[token]
            return bool(logits[best] - other < NEAR_TIE)

        return best, may_leave

    return _leaves_path_only_at_a_near_tie(model, prompt, got, n_tokens, greedy)


def leaves_coupled_path_only_at_a_near_tie(model: Model, prompt: str | list[int], got: list[int] | str,
                                           n_tokens: int, params: SamplingParams, seed: int) -> bool:
    """Whether `got` (token ids, or text) follows the target's own coupled samples for `seed` (decoded
    here, alone) until it ends or leaves them where the exponential race's two best keys (log p + noise,
    so a logit's rounding moves them by it over the temperature) were within NEAR_TIE / temperature."""
    def coupled(logits: np.ndarray, position: int) -> tuple[int, Callable[[int | None], bool]]:
        ids, keys = coupled_ranking(distribution(logits, params), seed, position, n=2)
        near_tie = bool(keys[0] - keys[1] < NEAR_TIE / params.temperature)
        return int(ids[0]), lambda token: near_tie and (token is None or token == ids[1])

    return _leaves_path_only_at_a_near_tie(model, prompt, got, n_tokens, coupled)


def _leaves_path_only_at_a_near_tie(model: Model, prompt: str | list[int], got: list[int] | str, n_tokens: int,
                                    choose: Choice) -> bool:
    """Walk the target's own path from `prompt` (decoded here, alone), token by token as `choose` picks
    it, while `got` follows it; where `got` leaves it, whether `choose` allows that there."""
    tokens = model.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    context = model.new_context(len(tokens) + n_tokens + 1)
    try:
        logits = context.decode(tokens, 0)[-1]
        text, wanted = b"", got.encode() if isinstance(got, str) else None
        for i in range(n_tokens):
            best, may_leave = choose(logits, len(tokens) + i)
            if isinstance(got, list):
                if i >= len(got):
                    return True
                if got[i] != best:
                    return may_leave(got[i])
            else:
                piece = b"" if model.is_end_of_generation(best) else model.token_piece(best)
                if not wanted.startswith(text + piece):
                    return may_leave(None)
                text += piece
            if model.is_end_of_generation(best):
                return True
            logits = context.decode([best], context.n_past)[-1]
        return True
    finally:
        context.close()
