"""StopMatcher: stop strings end the text where they first appear, across pieces, and are never shown."""

from __future__ import annotations

import pytest

from duo.api.serving.stop import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    """What each piece lets through, and whether a stop string ended the text (then nothing is flushed)."""
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_text_without_stop_strings_passes_through_unchanged():
    assert run([], ["a", "b"]) == (["a", "b", ""], False)


def test_text_before_a_stop_string_is_returned_and_the_stop_string_is_not():
    assert run(["END"], ["hello END world"]) == (["hello "], True)


def test_a_stop_string_split_across_pieces_is_held_back_then_cut():
    assert run(["\n\n"], ["a\n", "\nb"]) == (["a", ""], True)


def test_held_back_text_is_released_when_the_next_piece_rules_the_stop_string_out():
    assert run(["\n\n"], ["a\n", "b\n", "c"]) == (["a", "\nb", "\nc", ""], False)


def test_a_stop_string_spanning_three_pieces_is_found():
    assert run(["<end>"], ["x<e", "n", "d>y"]) == (["x", "", ""], True)


def test_the_earliest_of_several_stop_strings_wins():
    assert run(["world", "lo w"], ["hello world"]) == (["hel"], True)


def test_a_stop_string_at_the_very_start_gives_empty_text():
    assert run(["Once"], ["Once upon"]) == ([""], True)


def test_flush_returns_what_was_held_when_the_text_ends_otherwise():
    assert run(["STOP"], ["abc ST"]) == (["abc ", "ST"], False)


def test_only_the_longest_possible_start_of_a_stop_string_is_held():
    matcher = StopMatcher(["aab"])
    assert matcher.feed("xaaa") == ("xa", False)  # "aa" may still become "aab"
    assert matcher.feed("b") == ("", True)


def test_after_a_stop_nothing_more_is_returned():
    matcher = StopMatcher(["."])
    assert matcher.feed("a.b") == ("a", True)
    assert matcher.feed("more") == ("", True)


def test_an_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="empty"):
        StopMatcher([""])


def test_multibyte_characters_are_held_and_cut_like_any_other():
    assert run(["é!"], ["caf", "é", "!", " ok"]) == (["caf", "", ""], True)
