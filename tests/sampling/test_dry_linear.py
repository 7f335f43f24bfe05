"""DRY in linear time: its repeat lengths are the quadratic extension's (kept here as the reference) on random windows,
a row after a long repetition costs milliseconds, and a new list of sequence breakers is found in the real Qwen2.5
vocabulary by searches, with llama.cpp's restart sequences exactly as the token-by-token walk finds them; served, a
new list of MAX_BREAKERS is answered at once by the target and its draft, and a longer one is refused by name."""

from __future__ import annotations

import json
import time

import grpc
import numpy as np
import pytest

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.sampling.ops.dry import MAX_BREAKER_BYTES, MAX_BREAKERS, MAX_TAIL, Dry, restart_sequences
from helpers.http import post

# --- References: the quadratic algorithms DRY used, straightforward -------------------------------------------------


def quadratic_limit(dry: Dry, c: list[int]) -> int:
    """The tokens after the latest restart sequence: every head from the latest, each of its tails compared."""
    restarts = dry.restarts or {}
    for at in range(len(c) - 1, -1, -1):
        after = len(c) - 1 - at
        tails = [t for t in restarts.get(c[at], ()) if len(t) <= after and tuple(c[at + 1:at + 1 + len(t)]) == t]
        if tails:
            return after - max(len(t) for t in tails)
    return len(c)


def quadratic_repeat_lengths(dry: Dry, c: list[int]) -> dict[int, int]:
    """token -> the longest repetition it would extend (>= allowed_length; not the single-token breakers): each
    earlier place of the last token extended backwards one token at a time."""
    n, limit = len(c), quadratic_limit(dry, c)
    if n <= dry.allowed_length or limit < dry.allowed_length:
        return {}
    longest: dict[int, int] = {}
    for i in range(n - 1):
        length = 0
        while length < limit and length <= i and c[i - length] == c[n - 1 - length]:
            length += 1
        if length >= dry.allowed_length:
            longest[c[i + 1]] = max(longest.get(c[i + 1], 0), length)
    return {t: length for t, length in longest.items() if () not in (dry.restarts or {}).get(t, ())}


def penalty_row(dry: Dry, lengths: dict[int, int], n_vocab: int) -> np.ndarray:
    row = np.zeros(n_vocab)
    for token, length in lengths.items():
        row[token] = dry.multiplier * dry.base ** (length - dry.allowed_length)
    return row


RESTART_SHAPES = [
    {},
    {3: ((),)},                                   # a token that breaks alone
    {4: ((5,), (5, 6))},                           # a breaker spanning two and three tokens
    {3: ((),), 4: ((5,), (5, 6)), 1: ((2,), (), (2, 2, 2))},  # both kinds on one head
    {0: ((0, 0),)},                                # a breaker made of the repeated token itself
]


@pytest.mark.parametrize("allowed_length", [0, 1, 2, 3])
def test_repeat_lengths_are_the_quadratic_extensions_on_random_windows_with_many_repeats(allowed_length):
    rng = np.random.default_rng(allowed_length)
    for trial in range(1500):
        restarts = RESTART_SHAPES[trial % len(RESTART_SHAPES)]
        dry = Dry(multiplier=0.5, base=1.75, allowed_length=allowed_length, restarts=restarts,
                  penalty_last_n=int(rng.choice([-1, 5, 12, 30])))
        context = rng.integers(0, int(rng.integers(1, 5)) + 3, int(rng.integers(0, 50)))  # few tokens: many repeats
        window = dry.window(context.tolist())
        row = np.zeros(8)
        dry.apply(row, context)
        expected = penalty_row(dry, quadratic_repeat_lengths(dry, window.tolist()), 8)
        assert np.allclose(-row, expected, rtol=1e-12, atol=0), (context.tolist(), restarts)


def test_a_restart_sequence_at_the_end_or_not_yet_complete_limits_as_the_reference_says():
    dry = Dry(multiplier=1.0, base=2.0, allowed_length=1, restarts={4: ((5,), (5, 6))})
    for context in ([1, 2, 1, 2, 4], [1, 2, 4, 5, 1, 2, 1], [1, 4, 5, 6, 1, 1], [4, 5, 6], [4]):
        row = np.zeros(8)
        dry.apply(row, np.array(context))
        assert np.allclose(-row, penalty_row(dry, quadratic_repeat_lengths(dry, context), 8)), context


def seconds_per_row(dry: Dry, context: np.ndarray) -> float:
    """The fastest of three rows: the machine's other work only ever adds."""
    best = float("inf")
    for _ in range(3):
        row = np.zeros(16, dtype=np.float32)
        start = time.perf_counter()
        dry.apply(row, context)
        best = min(best, time.perf_counter() - start)
    return best


def test_a_row_after_16384_copies_of_one_token_takes_well_under_50_ms():
    """The quadratic extension took ~1 s here (one match per place, each as long as the window)."""
    dry = Dry(multiplier=0.8, restarts={})
    assert seconds_per_row(dry, np.full(16384, 7, dtype=np.int64)) < 0.05


def test_a_window_full_of_restart_sequences_never_completed_is_read_in_linear_time():
    """Every other token is the head of a two-token breaker whose second token never follows: each is a candidate
    that fails, and the repetition under it is the whole window."""
    dry = Dry(multiplier=0.8, restarts={4: ((5, 6),)})
    assert seconds_per_row(dry, np.array([4, 5] * 8192, dtype=np.int64)) < 0.1


# --- Sequence breakers in the real vocabulary ------------------------------------------------------------------------


def walked_restart_sequences(vocab, breakers: list[str]) -> dict[int, tuple[tuple[int, ...], ...]]:
    """llama.cpp's get_overlapping_token_sequences as written: every token's text, for every breaker."""
    pieces = [vocab.token_piece(token, special=True) for token in range(vocab.n_vocab)]
    found: dict[int, list[tuple[int, ...]]] = {}
    for text in breakers:
        breaker = text.encode()[:MAX_BREAKER_BYTES]
        if not breaker:
            continue
        for token, word in enumerate(pieces):
            if breaker in word:
                tails = [()]
            else:
                tails = [tuple(vocab.tokenize(breaker[len(word) - at:].decode(errors="ignore"), add_special=False,
                                              parse_special=False)[:MAX_TAIL])
                         for at in range(len(word)) if breaker.startswith(word[at:])]
            for tail in tails:
                if tail not in found.setdefault(token, []):
                    found[token].append(tail)
    return {head: tuple(tails) for head, tails in found.items() if tails}


BREAKERS = ["\n", ":", "\"", "*",              # llama-server's defaults
            "ab\"", " the end", "\n\n###",     # breakers that span tokens
            "é", "語", "🙂",                    # multi-byte UTF-8: tokens ending inside a character start them
            "<|im_end|>",                      # a special token's text
            "x" * 30 + "é" * 6]                # cut at 40 bytes, inside a character


def test_restart_sequences_in_the_real_vocabulary_are_the_walks(target_model):
    found = restart_sequences(target_model, BREAKERS)
    assert found == walked_restart_sequences(target_model, BREAKERS)
    assert len(found) > 1000  # the defaults alone make many heads: the comparison covers them


def test_64_new_breakers_are_found_in_the_real_vocabulary_well_within_a_second(target_model):
    """The walk took ~0.5 s a breaker (31.4 s for 64); the searches need no walk once the text is laid out."""
    restart_sequences(target_model, ["\n"])  # the vocabulary's text laid out: once per model
    breakers = [chr(ord("a") + i % 26) * (1 + i // 26) + "!" for i in range(32)]  # common letters: many heads
    breakers += [f"<{i}> end of turn {i}" for i in range(32)]                      # many bytes to search for
    start = time.perf_counter()
    found = restart_sequences(target_model, breakers)
    assert time.perf_counter() - start < 1.0
    assert found  # some tokens end with a letter or hold one: heads were found


def dry_body(breakers: list[str] | str) -> dict:
    return {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0, "dry_multiplier": 0.8,
            "dry_sequence_breakers": breakers}


def test_a_new_list_of_64_breakers_is_served_with_a_draft_within_seconds(served_sync):
    """The target (at the request's preparation) and the draft (at the session's opening) each find them; each walk
    took ~10-30 s."""
    assert post(served_sync, "/completion", dry_body(["\n"])).status_code == 200  # each lays its vocabulary out once
    breakers = [f"{time.monotonic_ns()} breaker {i}" for i in range(MAX_BREAKERS)]  # new to both processes
    start = time.perf_counter()
    response = post(served_sync, "/completion", dry_body(breakers))
    assert response.status_code == 200, response.text
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("encode", [list, json.dumps], ids=["array", "array in a string"])
def test_more_breakers_than_the_bound_answer_400_naming_dry_sequence_breakers(served_alone, encode):
    response = post(served_alone, "/completion", dry_body(encode([f"b{i}" for i in range(MAX_BREAKERS + 1)])))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "dry_sequence_breakers"


def test_more_breakers_than_the_bound_are_invalid_argument_over_grpc(served_alone):
    sampling = pb.SamplingParams(dry_multiplier=0.8, dry_sequence_breakers=[f"b{i}" for i in range(MAX_BREAKERS + 1)])
    channel = grpc.insecure_channel(served_alone.address)
    target = pb_grpc.TargetStub(channel)
    with channel, pytest.raises(grpc.RpcError) as error:
        list(target.Generate(pb.GenerateRequest(prompt="hi", max_tokens=4, sampling=sampling), timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "dry_sequence_breakers" in error.value.details()
