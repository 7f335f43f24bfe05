"""Idle sequences' prefixes parked in host memory (duo.llama.parking): out of the cache while they wait, back whole."""

from __future__ import annotations

import numpy as np
import pytest

from duo.llama.parking import MIB, Parking, parking_for

PROMPT = [(7 * i) % 900 + 100 for i in range(120)]
OTHER = [(11 * i) % 900 + 50 for i in range(40)]


@pytest.fixture
def context(target_model):
    context = target_model.new_context(256, n_seq=3, cells=512)
    yield context
    context.close()


def next_logits(context, seq: int, token: int = 42):
    """The logits after the sequence's tokens and `token` (then forgotten again)."""
    pos = context.past(seq)
    row = context.decode([token], pos, seq=seq)
    context.rollback(pos, seq)
    return row


def test_a_parked_sequence_leaves_the_cache_and_comes_back_answering_as_it_did(context):
    context.decode(PROMPT, 0, logits_for=[], seq=0)
    before = next_logits(context, 0)
    parking = Parking(context)
    parking.park([0])
    assert context.held(0) == [] and len(parking.entries) == 1
    assert parking.size > 0

    # A sequence the cells went to meanwhile: the restore finds another run of free cells.
    context.decode(OTHER, 0, logits_for=[], seq=1)
    assert parking.adopt(2, PROMPT + [5, 6]) == len(PROMPT)
    assert list(context.held(2)) == PROMPT and parking.restored == 1
    np.testing.assert_allclose(next_logits(context, 2), before, rtol=0, atol=1e-4)
    assert parking.entries == []  # the prompt continues it whole: the sequence holds it now


def test_the_cache_wins_where_it_holds_as_much_and_a_partial_match_keeps_the_parked_copy(context):
    context.decode(PROMPT, 0, logits_for=[], seq=0)
    parking = Parking(context)
    parking.park([0])
    context.decode(PROMPT[:50], 0, logits_for=[], seq=1)

    # 60 shared tokens: the parked copy gives more than sequence 1's 50, and stays parked (its tail is another turn's).
    assert parking.adopt(2, PROMPT[:60] + [1, 2, 3]) == 60
    assert list(context.held(2)) == PROMPT[:60] and len(parking.entries) == 1
    # 50 shared tokens: sequence 1 holds them already, so nothing is restored.
    context.clear(2)
    assert parking.adopt(2, PROMPT[:50] + [9]) == 50 and parking.restored == 1


def test_private_and_empty_sequences_are_cleared_never_parked_and_a_prefix_is_parked_once(context):
    context.decode(PROMPT, 0, logits_for=[], seq=0)
    context.decode(OTHER, 0, logits_for=[], seq=1)
    parking = Parking(context)
    parking.park([0, 1, 2], private={1})
    assert [context.held(seq) for seq in range(3)] == [[], [], []]
    assert [entry.tokens for entry in parking.entries] == [PROMPT]

    context.decode(PROMPT[:30], 0, logits_for=[], seq=0)  # contained in a parked prefix: nothing new to keep
    parking.park([0])
    assert [entry.tokens for entry in parking.entries] == [PROMPT]


def test_a_longer_turn_replaces_the_prefix_it_continues_and_the_oldest_go_first_past_the_limit(context):
    parking = Parking(context)
    context.decode(PROMPT[:40], 0, logits_for=[], seq=0)
    parking.park([0])
    context.decode(PROMPT, 0, logits_for=[], seq=0)
    parking.park([0])
    assert [entry.tokens for entry in parking.entries] == [PROMPT]

    per_token = parking.size / len(PROMPT)
    parking.limit_bytes = int(per_token * (len(PROMPT) + len(OTHER) + 10))
    context.decode(OTHER, 0, logits_for=[], seq=1)
    parking.park([1])
    assert [entry.tokens for entry in parking.entries] == [PROMPT, OTHER]
    third = [3] * 30
    context.decode(third, 0, logits_for=[], seq=2)
    parking.park([2])
    assert [entry.tokens for entry in parking.entries] == [OTHER, third]  # the oldest went

    parking.limit_bytes = int(per_token * 10)  # a prefix larger than the whole limit is not kept
    context.decode(PROMPT, 0, logits_for=[], seq=0)
    parking.park([0])
    assert [entry.tokens for entry in parking.entries] == [OTHER, third] and context.held(0) == []


def test_with_no_run_of_free_cells_the_prefix_is_read_again_and_stays_parked(target_model):
    context = target_model.new_context(256, n_seq=3, cells=256)
    try:
        context.decode(PROMPT, 0, logits_for=[], seq=0)
        parking = Parking(context)
        parking.park([0])
        context.decode(PROMPT[:10] + OTHER * 4, 0, logits_for=[], seq=1)  # 170 of 256 cells: 86 left, not 120
        assert parking.adopt(2, PROMPT + [1]) == 10  # what sequence 1 shares, from the cache
        assert list(context.held(2)) == PROMPT[:10] and len(parking.entries) == 1 and parking.restored == 0
    finally:
        context.close()


def test_cache_ram_sets_the_limit_none_for_zero_and_no_limit_below(context):
    assert parking_for(context, 0) is None
    assert parking_for(context, -1).limit_bytes is None
    assert parking_for(context, 100).limit_bytes == 100 * MIB


def test_a_sequence_taken_for_another_conversation_parks_what_it_held_first(context):
    context.decode(PROMPT, 0, logits_for=[], seq=0)
    parking = Parking(context)
    assert parking.adopt(0, OTHER, tag=448) == 0  # another conversation on the same sequence
    assert [(entry.tokens, entry.tag) for entry in parking.entries] == [(PROMPT, 448)] and context.held(0) == []
    context.decode(OTHER, 0, logits_for=[], seq=0)
    assert parking.adopt(0, PROMPT + [1]) == len(PROMPT) and [e.tokens for e in parking.entries] == [OTHER]
    assert parking.adopt(0, PROMPT + [1, 2]) == len(PROMPT) and parking.restored == 1  # its own cells: no copy
    assert parking.adopt(1, [9, 9], private={1}) == 0 and len(parking.entries) == 1


def test_a_sequence_sharing_part_of_a_new_prompt_keeps_its_cells_and_parks_a_copy_of_the_rest(context):
    context.decode(PROMPT, 0, logits_for=[], seq=0)
    parking = Parking(context)
    assert parking.adopt(0, PROMPT[:100] + [1]) == 100
    assert list(context.held(0)) == PROMPT[:100] and parking.restored == 0  # rolled back, not copied out and in
    assert [entry.tokens for entry in parking.entries] == [PROMPT]


def test_at_most_max_parked_prefixes_are_kept_the_oldest_dropped(context, monkeypatch):
    from duo.llama import parking as parking_module

    monkeypatch.setattr(parking_module, "MAX_PARKED", 3)
    parking = Parking(context)
    for first in range(5):
        context.decode([first + 1, 7, 8], 0, logits_for=[], seq=0)
        parking.park([0])
    assert [entry.tokens[0] for entry in parking.entries] == [3, 4, 5]
