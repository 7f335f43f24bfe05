"""tests/helpers/greedy.py, the near-tie helpers every cross-run comparison goes through: on a scripted model, they
pass the target's own path and near-ties taken anywhere, and refuse what a broken generation gives (a
wrong token, garbage after a near-tie, a truncated or empty answer)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from duo.sampling.coupled import coupled_ranking

from duo.sampling.distributions import distribution

from duo.sampling.params import SamplingParams
from helpers.greedy import NEAR_TIE, leaves_coupled_path_only_at_a_near_tie, leaves_greedy_path_only_at_a_near_tie

VOCAB, EOS = 12, 11
TIE_AFTER = (1, 2)  # after these tokens, the best two logits are within a near-tie


def scripted_logits(held: Sequence[int]) -> np.ndarray:
    """The next token is (last * 5 + 3) % 11, by a margin of 4; after TIE_AFTER, token 7 is within half a
    near-tie of it; 12 tokens in, EOS wins."""
    logits = np.zeros(VOCAB, dtype=np.float32)
    if len(held) >= 12:
        logits[EOS] = 4.0
        return logits
    logits[(held[-1] * 5 + 3) % 11] = 4.0
    if tuple(held[-2:]) == TIE_AFTER:
        logits[7] = 4.0 - NEAR_TIE / 2
    return logits


class ScriptedContext:
    def __init__(self) -> None:
        self.held: list[int] = []

    @property
    def n_past(self) -> int:
        return len(self.held)

    def decode(self, tokens: Sequence[int], pos: int) -> np.ndarray:
        assert pos == len(self.held)
        self.held += list(tokens)
        return scripted_logits(self.held)[None, :]

    def close(self) -> None:
        pass


class ScriptedModel:
    def tokenize(self, text: str) -> list[int]:
        return [int(c) for c in text]

    def new_context(self, n_ctx: int) -> ScriptedContext:
        return ScriptedContext()

    def is_end_of_generation(self, token: int) -> bool:
        return token == EOS

    def token_piece(self, token: int) -> bytes:
        return b"<%d>" % token


def own_path(prompt: list[int], n: int, take_tie: bool = False) -> list[int]:
    """The scripted greedy path (the near-tie's runner-up taken where take_tie), to EOS or n tokens."""
    held, out = list(prompt), []
    while len(out) < n:
        logits = scripted_logits(held)
        token = 7 if take_tie and tuple(held[-2:]) == TIE_AFTER else int(np.argmax(logits))
        if token == EOS:
            break
        held.append(token)
        out.append(token)
    return out


MODEL, PROMPT = ScriptedModel(), [1, 2]  # the prompt ends on TIE_AFTER: the first token is a near-tie


def test_the_targets_own_path_passes_and_so_does_the_near_tie_with_the_path_that_follows_it():
    assert leaves_greedy_path_only_at_a_near_tie(MODEL, PROMPT, own_path(PROMPT, 6), 6)
    tied = own_path(PROMPT, 6, take_tie=True)
    assert tied[0] == 7 and tied != own_path(PROMPT, 6)
    assert leaves_greedy_path_only_at_a_near_tie(MODEL, PROMPT, tied, 6)


def test_garbage_after_a_near_tie_fails():
    tied = own_path(PROMPT, 6, take_tie=True)
    assert not leaves_greedy_path_only_at_a_near_tie(MODEL, PROMPT, tied[:3] + [(tied[3] + 1) % 11] + tied[4:], 6)
    # nor may the answer go back to the untied path after taking the runner-up
    assert not leaves_greedy_path_only_at_a_near_tie(MODEL, PROMPT, [7] + own_path(PROMPT, 6)[1:], 6)


def test_a_wrong_token_away_from_a_near_tie_fails():
    path = own_path([3], 6)
    assert leaves_greedy_path_only_at_a_near_tie(MODEL, [3], path, 6)
    assert not leaves_greedy_path_only_at_a_near_tie(MODEL, [3], path[:2] + [(path[2] + 1) % 11] + path[3:], 6)


def test_a_truncated_or_empty_answer_fails_unless_the_target_ends_there():
    path = own_path(PROMPT, 6)
    assert not leaves_greedy_path_only_at_a_near_tie(MODEL, PROMPT, path[:4], 6)
    assert not leaves_greedy_path_only_at_a_near_tie(MODEL, PROMPT, [], 6)
    # 12 tokens held, EOS wins: an answer of 10 tokens after a 2-token prompt ended where it should
    whole = own_path(PROMPT, 40)
    assert len(whole) == 10
    assert leaves_greedy_path_only_at_a_near_tie(MODEL, PROMPT, whole, 40)
    assert leaves_greedy_path_only_at_a_near_tie(MODEL, PROMPT, whole + [EOS], 40)  # with its EOS too
    assert not leaves_greedy_path_only_at_a_near_tie(MODEL, PROMPT, whole + [EOS, 3], 40)


def test_text_answers_are_checked_to_their_end_too():
    def text(tokens: list[int]) -> str:
        return "".join(MODEL.token_piece(t).decode() for t in tokens)

    assert leaves_greedy_path_only_at_a_near_tie(MODEL, PROMPT, text(own_path(PROMPT, 6, take_tie=True)), 6)
    assert not leaves_greedy_path_only_at_a_near_tie(MODEL, PROMPT, text(own_path(PROMPT, 6)[:3]), 6)
    assert not leaves_greedy_path_only_at_a_near_tie(MODEL, PROMPT, "", 6)
    assert leaves_greedy_path_only_at_a_near_tie(MODEL, PROMPT, text(own_path(PROMPT, 40)), 40)


def test_the_coupled_check_follows_the_seeds_samples_to_the_end():
    params = SamplingParams(temperature=1.0)

    def coupled_path(seed: int, n: int) -> list[int]:
        held, out = list(PROMPT), []
        while len(out) < n:
            ids, _ = coupled_ranking(distribution(scripted_logits(held), params), seed, len(held), n=1)
            if int(ids[0]) == EOS:
                break
            held.append(int(ids[0]))
            out.append(int(ids[0]))
        return out

    path = coupled_path(5, 8)
    assert leaves_coupled_path_only_at_a_near_tie(MODEL, PROMPT, path, 8, params, 5)
    assert not leaves_coupled_path_only_at_a_near_tie(MODEL, PROMPT, path[:5], 8, params, 5)
    other = next(coupled_path(seed, 8) for seed in range(6, 50) if coupled_path(seed, 8) != path)
    assert not leaves_coupled_path_only_at_a_near_tie(MODEL, PROMPT, other, 8, params, 5)
