"""n > 1 (OpenAI's n and best_of = n, llama-server's n_cmpl): several choices of one prompt, each speculated, the
prompt decoded once and its cells shared, answered whole and streamed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from helpers.http import greedy_text, post, streamed

PROMPT = "def fibonacci(n):"


def test_each_choice_is_the_request_alone_with_its_own_seed_and_shares_the_prompts_cells(served_sync):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 7}
    answer = post(served_sync, "/v1/completions", {**body, "n": 3}).json()
    texts = [choice["text"] for choice in answer["choices"]]
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    # Seeded choices are coupled samples: choice i is exactly what the request alone gives with seed 7 + i.
    alone = [post(served_sync, "/v1/completions", {**body, "seed": 7 + i}).json()["choices"][0]["text"]
             for i in range(3)]
    assert texts == alone and len(set(texts)) > 1
    stats = answer["duo_stats"]
    assert [s["seed"] for s in stats] == [7, 8, 9] and all(s["draft_tokens_verified"] > 0 for s in stats)
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert all(s["cached_prompt_tokens"] == prompt_tokens - 1 for s in stats[1:])  # decoded once, then shared
    assert answer["usage"]["completion_tokens"] == sum(s["generated_tokens"] for s in stats)


def test_streamed_chat_choices_come_marked_by_index_with_one_usage_and_one_done(served_sync):
    messages = [{"role": "user", "content": "Write a haiku."}]
    chunks = streamed(served_sync, "/v1/chat/completions", {"messages": messages, "max_tokens": 10, "temperature": 0,
                                                           "n": 2, "stream_options": {"include_usage": True}},
                      done=True)  # one [DONE], last
    usage = [chunk["usage"] for chunk in chunks if chunk["choices"] == []]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == 20
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    whole = post(served_sync, "/v1/chat/completions", {"messages": messages, "max_tokens": 10,
                                                       "temperature": 0}).json()
    assert texts[0] == texts[1] == whole["choices"][0]["message"]["content"]  # greedy: the same text twice


def test_llama_servers_n_cmpl_answers_an_array_of_native_answers(served_sync):
    answers = post(served_sync, "/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0,
                                                "n_cmpl": 2}).json()
    assert [a["index"] for a in answers] == [0, 1]
    assert all(a["content"] == greedy_text(served_sync, PROMPT, 6) and a["tokens_predicted"] == 6 for a in answers)


def test_choices_beyond_what_the_target_runs_at_once_or_unranked_best_of_are_refused(served_alone):
    for body, param in [({"n": 64}, "n"), ({"n": 0}, "n"), ({"n_cmpl": 2, "n": 3}, "n_cmpl"),
                        ({"n": 2, "best_of": 3}, "best_of"), ({"n": 2, "seed": -2}, "seed")]:
        response = post(served_alone, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (body, response.text)
    assert post(served_alone, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 2,
                                                  "best_of": 2}).status_code == 200


def test_requests_of_several_choices_at_once_never_wait_for_each_others_places(served_sync):
    # --parallel 4: two requests of three choices, each taking its places one by one, could hold two each and wait
    # for the other's forever.
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "n": 3}
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: post(served_sync, "/v1/completions", body), range(2)))
    assert [a.status_code for a in answers] == [200, 200] and all(len(a.json()["choices"]) == 3 for a in answers)
