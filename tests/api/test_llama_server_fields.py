"""The fields of llama-server's answers that its own test suite and its clients read, on duo: /completion's
index, id_slot, generation_settings, prompt, has_new_line, truncated and timings.cache_n, response_fields [] for every
field, /props' default params, OpenAI answers' system_fingerprint, a streamed chat opening with content null, and
CORS preflights answered 200 as llama-server answers them."""

from __future__ import annotations

import httpx

from conftest import CONTEXT_SIZE
from helpers.asgi import asgi_call, unloaded_app
from helpers.http import post, streamed

PROMPT = "I believe the meaning of life is"
PAGE = "https://page.example"  # a public page
ALLOWED = "http://allowed.example:3000"


def completion(process, **fields) -> dict:
    response = post(process, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_completion_carries_llama_servers_fields(served_alone, target_model):
    body = completion(served_alone, seed=42, stop=["\n\n\n"])
    prompt_ids = target_model.tokenize(PROMPT)
    assert body["index"] == 0 and isinstance(body["id_slot"], int)
    assert body["prompt"] == target_model.detokenize(prompt_ids, special=True).decode()
    assert body["has_new_line"] == ("\n" in body["content"])
    assert body["truncated"] is False
    settings = body["generation_settings"]
    assert settings["n_predict"] == 8 and settings["seed"] == 42 and settings["temperature"] == 0
    assert settings["stop"] == ["\n\n\n"] and "adaptive_target" in settings and "adaptive_decay" in settings
    timings = body["timings"]
    assert timings["prompt_n"] + timings["cache_n"] == body["tokens_evaluated"] == len(prompt_ids)


def test_the_cache_shows_in_timings_cache_n_on_a_repeated_prompt(served_alone):
    completion(served_alone)
    again = completion(served_alone)["timings"]
    assert again["cache_n"] > 0 and again["prompt_n"] + again["cache_n"] == completion(served_alone)[
        "tokens_evaluated"]


def test_an_answer_that_fills_the_context_is_truncated(served_alone):
    body = completion(served_alone, n_predict=-1, ignore_eos=True)
    assert body["stop_type"] == "limit" and body["truncated"] is True
    assert body["tokens_evaluated"] + body["tokens_predicted"] == CONTEXT_SIZE


def test_response_fields_pick_paths_and_an_empty_list_answers_every_field(served_alone):
    picked = completion(served_alone, response_fields=["content", "generation_settings/n_predict", "prompt"])
    assert set(picked) == {"content", "generation_settings/n_predict", "prompt"}
    assert picked["generation_settings/n_predict"] == 8 and picked["prompt"].endswith(PROMPT)
    every = completion(served_alone, response_fields=[])
    assert {"content", "generation_settings", "timings", "truncated", "has_new_line"} <= set(every)


def test_a_streamed_completion_ends_with_the_fields_of_a_whole_one(served_alone):
    events = streamed(served_alone, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0}, done=False)
    last = events[-1]
    assert all(event["index"] == 0 for event in events)
    assert last["generation_settings"]["n_predict"] == 8 and last["truncated"] is False
    assert last["has_new_line"] == any("\n" in event["content"] for event in events)


def test_props_show_the_default_generation_params(served_alone):
    params = httpx.get(f"{served_alone.http_url}/props", timeout=10).json()["default_generation_settings"]["params"]
    assert params["n_predict"] == -1 and params["seed"] == 2**32 - 1  # no -n, no --seed: until the end, random
    assert {"temperature", "top_k", "top_p", "min_p", "mirostat"} <= set(params)


def test_openai_answers_carry_a_system_fingerprint_and_a_stream_opens_with_content_null(served_alone):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    whole = post(served_alone, "/v1/chat/completions", chat).json()
    assert whole["system_fingerprint"].startswith("b")
    text = post(served_alone, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}).json()
    assert text["system_fingerprint"] == whole["system_fingerprint"]
    chunks = streamed(served_alone, "/v1/chat/completions", chat)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(chunk["system_fingerprint"] == whole["system_fingerprint"] for chunk in chunks)


def preflight(app, origin: str):
    """The suite's preflight (test_security.py): a POST with an Authorization header."""
    return asgi_call(app, "OPTIONS", "/completions", {"Origin": origin, "Access-Control-Request-Method": "POST",
                                                      "Access-Control-Request-Headers": "Authorization"})


def test_a_preflight_is_answered_200_with_llama_servers_methods():
    answer = preflight(unloaded_app(), PAGE)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == PAGE
    assert answer.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert answer.headers["access-control-allow-credentials"] == "true"
    assert answer.headers["access-control-allow-headers"] == "*"  # llama-server's; a listed origin gets what it asks


def test_a_preflight_from_an_origin_off_the_list_gets_no_cors_headers_and_its_request_is_refused():
    app = unloaded_app(origins=[ALLOWED])
    answer = preflight(app, PAGE)
    assert answer.status_code == 200 and not any(name.startswith("access-control-") for name in answer.headers)
    assert asgi_call(app, "POST", "/completion", {"Origin": PAGE}, b"{}").status_code == 403  # duo's guard stays


def test_the_token_counting_routes_count_the_prompt_the_generation_reads(served_alone):
    chat = {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]}
    read = post(served_alone, "/v1/chat/completions", {**chat, "max_tokens": 0}).json()["usage"]["prompt_tokens"]
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        counted = post(served_alone, path, chat)
        assert counted.status_code == 200 and counted.json() == {"input_tokens": read}, path
    items = {"input": "What is the best book", "instructions": "Book"}
    answered = post(served_alone, "/v1/responses", {**items, "max_output_tokens": 16}).json()["usage"]["input_tokens"]
    for path in ("/responses/input_tokens", "/v1/responses/input_tokens"):
        assert post(served_alone, path, items).json() == {"input_tokens": answered}, path


def test_timings_per_token_puts_the_timings_so_far_on_every_event(served_alone):
    chat = streamed(served_alone, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "test"}], "max_tokens": 10, "timings_per_token": True,
        "stream_options": {"include_usage": True}})
    assert "timings" not in chat[0] and all("timings" in chunk for chunk in chat[1:])
    assert chat[-1]["choices"] == [] and chat[-1]["timings"]["predicted_n"] == chat[-1]["usage"]["completion_tokens"]
    native = streamed(served_alone, "/completion", {"prompt": PROMPT, "n_predict": 8, "timings_per_token": True})
    assert all("timings" in event for event in native)
    assert native[-1]["generation_settings"]["timings_per_token"] is True


def test_openai_answers_end_with_llama_servers_timings(served_alone):
    chat = {"messages": [{"role": "user", "content": "test"}], "max_tokens": 6, "temperature": 0}
    whole = post(served_alone, "/v1/chat/completions", chat).json()
    assert whole["timings"]["predicted_n"] == whole["usage"]["completion_tokens"]
    chunks = streamed(served_alone, "/v1/chat/completions", chat)
    assert [("timings" in chunk) for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    text = post(served_alone, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}).json()
    assert text["timings"]["prompt_n"] + text["timings"]["cache_n"] == text["usage"]["prompt_tokens"]


def test_verbose_puts_the_native_answer_with_its_prompt_in_a_whole_openai_answer(served_alone, target_model):
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    verbose = post(served_alone, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "verbose": True})
    native = verbose.json()["__verbose"]
    assert native["prompt"] == target_model.chat_prompt(messages)  # the template's text, special tokens spelled out
    assert native["content"] == verbose.json()["choices"][0]["message"]["content"]
    assert native["generation_settings"]["n_predict"] == 2 and native["tokens_predicted"] <= 2
    plain = post(served_alone, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "verbose": False})
    assert "__verbose" not in plain.json()
    text = post(served_alone, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "verbose": True}).json()
    assert text["__verbose"]["prompt"].endswith(PROMPT)
