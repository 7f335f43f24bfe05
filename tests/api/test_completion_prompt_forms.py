"""llama-server's prompt forms on /completion: ids and text mixed in one prompt, the {"prompt_string"} object, a batch
of prompts (an array of answers, each with its index; streamed, each chunk with its index); what duo cannot serve
(multimodal data, a batch larger than --parallel) a 400 naming the field; exact under speculation."""

from __future__ import annotations

import pytest

from duo.api.llama_server.bodies import NativeCompletionBody
from duo.api.serving.prepare import Preparer
from duo.api.serving.request import BadRequest
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.http import post, streamed

TEXT = "I believe the meaning of life is"


def prompt_tokens(model, prompt) -> list[int]:
    request = NativeCompletionBody.model_validate({"prompt": prompt, "n_predict": 4}).to_request()
    return list(Preparer(model, 512).prepare(request)[0].prompt_tokens)


def refused(prompt) -> BadRequest:
    with pytest.raises(BadRequest) as refusal:
        NativeCompletionBody.model_validate({"prompt": prompt, "n_predict": 4}).to_requests()
    return refusal.value


def test_ids_and_text_in_one_prompt_are_tokenized_where_they_stand_with_bos_only_before_a_leading_text(target_model):
    text = target_model.tokenize(TEXT, add_special=False)
    assert prompt_tokens(target_model, [1, 2, TEXT, 3]) == [1, 2, *text, 3]
    assert prompt_tokens(target_model, [TEXT, 3]) == [*target_model.tokenize(TEXT), 3]


@pytest.mark.parametrize("form", [{"prompt_string": TEXT}, [TEXT], [{"prompt_string": TEXT}]])
def test_the_object_form_and_a_batch_of_one_are_the_text_prompt(target_model, form):
    assert prompt_tokens(target_model, form) == prompt_tokens(target_model, TEXT)


def test_the_object_forms_prompt_string_may_mix_ids_and_text(target_model):
    assert prompt_tokens(target_model, {"prompt_string": [5, TEXT]}) == prompt_tokens(target_model, [5, TEXT])


@pytest.mark.parametrize("prompt,param", [
    ({"prompt_string": TEXT, "multimodal_data": ["iVBORw0KGgo="]}, "prompt.multimodal_data"),
    ({"text": TEXT}, "prompt.prompt_string"),
    ([[1, 2], TEXT, ["a", "b"]], "prompt[2]"),
    ([1, 2.5, TEXT], "prompt[1]"),
    ([1, None], "prompt[1]"),
])
def test_what_duo_cannot_serve_is_a_400_naming_the_field(prompt, param):
    assert refused(prompt).param == param


def test_a_mixed_prompt_greedy_with_a_draft_is_the_target_alone(served_duo, target_model):
    answer = post(served_duo, "/completion", {"prompt": [TEXT, 11, 12], "n_predict": 16, "temperature": 0})
    assert answer.status_code == 200, answer.text
    tokens = [*target_model.tokenize(TEXT), 11, 12]
    assert leaves_greedy_path_only_at_a_near_tie(target_model, tokens, answer.json()["content"], 16)


def test_a_batch_answers_an_array_one_answer_per_prompt_in_order_each_the_target_alones_greedy(served_duo,
                                                                                                   target_model):
    ids = target_model.tokenize(TEXT)
    answer = post(served_duo, "/completion", {"prompt": [ids, {"prompt_string": "Once upon"}, TEXT],
                                              "n_predict": 12, "temperature": 0})
    assert answer.status_code == 200, answer.text
    answers = answer.json()
    assert [each["index"] for each in answers] == [0, 1, 2]
    assert answers[0]["content"] == answers[2]["content"]  # the same prompt, as ids and as text
    for prompt, each in zip([ids, target_model.tokenize("Once upon"), ids], answers):
        assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, each["content"], 12)


def test_a_streamed_batch_marks_each_chunk_with_its_prompts_index(served_duo):
    body = {"prompt": [TEXT, "Once upon"], "n_predict": 8, "temperature": 0}
    whole = post(served_duo, "/completion", body).json()
    texts = {0: "", 1: ""}
    for chunk in streamed(served_duo, "/completion", body):
        texts[chunk["index"]] += chunk["content"]
    assert texts == {0: whole[0]["content"], 1: whole[1]["content"]}


def test_a_batch_larger_than_the_places_is_a_400_naming_the_prompt(served_duo):
    answer = post(served_duo, "/completion", {"prompt": [TEXT] * 5, "n_predict": 2})  # served_duo: --parallel 4
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt", answer.text
