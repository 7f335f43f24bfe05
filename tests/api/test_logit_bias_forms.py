"""logit_bias in every form llama-server reads: token ids or texts (each of a text's tokens biased), as an object or a
list of pairs, false for never; a token named twice gets both biases; ignore_eos shows as its bans in
generation_settings, as llama-server shows it. The biases apply on both sides: exact under speculation."""

from __future__ import annotations

import math

import pytest

from duo.api.openai.bodies import CompletionBody
from duo.api.serving.request import BadRequest
from duo.sampling.ops.penalties import summed_biases
from helpers.http import post

PROMPT = "What is the best book"


def request_of(logit_bias):
    return CompletionBody(prompt="x", logit_bias=logit_bias).to_request()


def test_an_objects_whole_number_keys_are_ids_and_its_other_keys_texts():
    request = request_of({"12": 3, " 7": -1, " the": -2, "+4": 1})
    assert request.penalties.bias == ((4, 1.0), (7, -1.0), (12, 3.0))
    assert request.bias_texts == ((" the", -2.0),)


def test_a_lists_integers_are_ids_and_its_strings_texts_digits_too():
    request = request_of([[5, False], ["hello", -100], ["42", 2]])
    assert request.penalties.bias == ((5, -math.inf),)
    assert request.bias_texts == (("hello", -100.0), ("42", 2.0))


def test_a_token_named_twice_gets_both_biases_a_ban_stays_one():
    assert request_of([[5, -1], [5, -2.5], [6, False], [6, 3]]).penalties.bias == ((5, -3.5), (6, -math.inf))
    # No bound on the sum, as llama.cpp adds every entry: ids summed first and the texts' tokens after give one sum.
    assert summed_biases([(1, -80), (1, -80), (2, 90), (2, 90)]) == ((1, -160.0), (2, 180.0))
    assert summed_biases([*summed_biases([(1, 80), (1, 80)]), (1, -50)]) == ((1, 110.0),)


@pytest.mark.parametrize("pair", [[1.5, 1], [True, 1], [None, 1], ["x", True], ["x", 101]])
def test_what_is_neither_an_id_nor_a_text_with_a_bias_is_refused_naming_logit_bias(pair):
    with pytest.raises(BadRequest) as refused:
        request_of([pair])
    assert refused.value.param == "logit_bias"


def test_a_key_of_more_digits_than_python_reads_as_a_number_is_refused_naming_logit_bias():
    with pytest.raises(BadRequest) as refused:  # int() gives up past 4300 digits: that was a 500
        request_of({"9" * 5000: 1})
    assert refused.value.param == "logit_bias"


def completion(process, **fields) -> dict:
    response = post(process, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_text_biases_ban_its_tokens_as_their_ids_do_with_a_draft_attached(served_sync, served_alone, target_model):
    plain = completion(served_sync)["content"]
    words = plain.split()[:3]
    as_texts = completion(served_sync, logit_bias=[[" " + word, -100] for word in words])
    tokens = [token for word in words for token in target_model.tokenize(" " + word, add_special=False,
                                                                         parse_special=False)]
    as_ids = completion(served_sync, logit_bias={str(token): -100 for token in tokens})
    assert as_texts["content"] == as_ids["content"] != plain
    assert not set(tokens) & set(as_texts["tokens"])
    assert as_texts["timings"]["draft_n_accepted"] > 0
    alone = completion(served_alone, logit_bias=[[" " + word, -100] for word in words])
    assert alone["content"] == as_texts["content"]  # the target alone gives the same text
    shown = {entry["token"] for entry in as_texts["generation_settings"]["logit_bias"]}
    assert shown == set(tokens)


def test_ignore_eos_shows_its_bans_in_generation_settings(served_alone, target_model):
    banned = completion(served_alone, ignore_eos=True, n_predict=4)["generation_settings"]["logit_bias"]
    assert banned and {entry["token"] for entry in banned} == set(target_model.end_of_generation_ids())
    assert all(entry["bias"] is None for entry in banned)  # -inf, null in JSON as llama-server writes it
    assert completion(served_alone, ignore_eos=False, n_predict=4)["generation_settings"]["logit_bias"] == []


def test_a_token_named_in_several_texts_and_by_id_sums_past_100_and_is_served_with_a_draft_attached(
        served_sync, target_model):
    """llama-server's own test_logit_bias names words in many texts at -100 each: a token met twice sums to -200,
    which both processes take (the draft checks what it is sent). Here " the" is met four times: once as a text,
    twice in " the the" (each of a text's tokens is biased), once by id."""
    [token] = target_model.tokenize(" the", add_special=False)
    answer = completion(served_sync, logit_bias=[[" the", -100], [" the the", -100], [token, -100]])
    assert {entry["token"]: entry["bias"] for entry in answer["generation_settings"]["logit_bias"]}[token] == -400
    assert token not in answer["tokens"] and answer["timings"]["draft_n_accepted"] > 0
