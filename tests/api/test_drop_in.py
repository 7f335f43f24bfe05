"""duo-target as llama-server answers: any model name, CORS and the key as it takes them, prefix-less routes and
/slots, fields it does not read ignored, seed -1, its context-overflow error, warm-ups that read the prompt."""

from __future__ import annotations

import math

import httpx
import pytest

from conftest import CONTEXT_SIZE
from duo.cli.llama_launch import served_names
from helpers.asgi import asgi_call, unloaded_app
from helpers.http import post, streamed

ORIGIN = "http://page.example:3000"
KEY = "sekrit"


# --- CORS and the key ----------------------------------------------------------------------------------


def test_a_preflight_is_answered_without_the_key():
    response = asgi_call(unloaded_app(KEY), "OPTIONS", "/v1/chat/completions", {
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
        "Access-Control-Request-Private-Network": "true"})
    assert response.status_code == 200  # as llama-server answers it
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert response.headers["access-control-allow-credentials"] == "true"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert response.headers["access-control-allow-headers"] == "*"  # llama-server's (X-Api-Key carries the key)
    assert response.headers["access-control-allow-private-network"] == "true"


def test_cross_origin_answers_echo_the_origin_errors_included_so_a_page_can_read_them():
    app = unloaded_app(KEY)
    models = asgi_call(app, "GET", "/v1/models", {"Origin": ORIGIN})  # public, as llama-server's
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == ORIGIN
    refused = asgi_call(app, "POST", "/v1/chat/completions", {"Origin": ORIGIN})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert "access-control-allow-origin" not in asgi_call(app, "GET", "/v1/models").headers  # no Origin, no CORS


@pytest.mark.parametrize("headers", [{"Authorization": "Bearer sekrit"}, {"Authorization": "sekrit"},
                                     {"X-Api-Key": "sekrit"}, {"authorization": "bearer sekrit"}],
                         ids=["Bearer", "bare key", "X-Api-Key", "lower-case bearer"])
def test_the_key_is_taken_as_llama_server_takes_it(headers):
    app = unloaded_app(KEY)
    assert asgi_call(app, "GET", "/slots", headers).status_code == 200
    assert asgi_call(app, "GET", "/slots").status_code == 401
    assert asgi_call(app, "GET", "/slots", {"X-Api-Key": "wrong"}).status_code == 401
    assert asgi_call(app, "GET", "/slots", {"Authorization": "Bearer sekritX"}).status_code == 401


def test_health_and_the_model_list_stay_public_with_a_key():
    app = unloaded_app(KEY)
    for path in ("/v1/models", "/models", "/v1/models/anything"):
        assert asgi_call(app, "GET", path).status_code == 200, path
    for path in ("/health", "/v1/health"):
        assert asgi_call(app, "GET", path).status_code == 503, path  # public, and says the model is loading
    assert asgi_call(app, "GET", "/props").status_code == 401


def test_head_is_answered_as_get_without_a_body_as_llama_servers_http_server_answers_it():
    app = unloaded_app(KEY)  # Claude Code's first request: HEAD of its base URL, public as the page is
    for path in ("/", "/v1/models"):
        got, head = asgi_call(app, "GET", path), asgi_call(app, "HEAD", path)
        assert head.status_code == got.status_code == 200, path
        assert head.headers["content-type"] == got.headers["content-type"] and head.content == b"", path
    assert asgi_call(app, "HEAD", "/slots").status_code == 401  # the key still guards what GET guards
    key = {"Authorization": "Bearer sekrit"}
    assert asgi_call(app, "HEAD", "/v1/chat/completions", key).status_code == 405  # POST routes take no HEAD


def test_cors_origin_narrows_the_origins_answered():
    app = unloaded_app(KEY, origins=["http://allowed.example"])
    allowed = asgi_call(app, "GET", "/v1/models", {"Origin": "http://allowed.example"})
    assert allowed.headers["access-control-allow-origin"] == "http://allowed.example"
    other = asgi_call(app, "GET", "/v1/models", {"Origin": ORIGIN})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers  # refused, not run
    preflight = asgi_call(app, "OPTIONS", "/v1/models", {"Origin": ORIGIN, "Access-Control-Request-Method": "GET"})
    # a preflight runs nothing: answered as llama-server answers it, without CORS headers (the browser stops there)
    assert preflight.status_code == 200 and "access-control-allow-origin" not in preflight.headers


# --- model names ------------------------------------------------------------------------------------------


def test_the_model_is_listed_once_under_its_first_alias_as_llama_server_lists_it(tiny_target):
    names = served_names(tiny_target, str(tiny_target), ["qwen,gpt-4o", "gpt-4o"])
    assert names == ["gpt-4o", "qwen"]
    listed = asgi_call(unloaded_app(names=names), "GET", "/v1/models").json()["data"]
    assert [card["id"] for card in listed] == ["gpt-4o"]


def test_any_model_name_is_served_and_echoed(served_alone):
    for name in ("gpt-3.5-turbo", "openai/qwen2.5-coder", "google/gemini-2.5-flash"):
        response = post(served_alone, "/chat/completions", {"model": name, "max_tokens": 2,
                                                            "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == name


# --- routes --------------------------------------------------------------------------------------------------


def test_routes_without_v1_and_slots_answer_as_llama_servers(served_alone, tiny_target):
    models = httpx.get(f"{served_alone.http_url}/models").json()
    assert models["data"][0]["id"] == tiny_target.stem
    assert httpx.get(f"{served_alone.http_url}/v1/health").json()["status"] == "ok"
    slots = httpx.get(f"{served_alone.http_url}/slots").json()
    assert len(slots) >= 1 and all(slot["n_ctx"] == CONTEXT_SIZE for slot in slots)
    assert [slot["id"] for slot in slots] == list(range(len(slots))) and not any(s["is_processing"] for s in slots)


# --- fields -------------------------------------------------------------------------------------------------


def test_fields_llama_server_does_not_read_are_ignored_and_logged_once(served_alone):
    body = {"prompt": "hi", "n_predict": 2, "ban_eos_token": False, "typical": 1, "num_ctx": 4096,
            "keep_alive": "5m", "duo_test_only_field": 1}
    for _ in range(2):
        response = post(served_alone, "/completion", body)
        assert response.status_code == 200, response.text
    assert served_alone.log().count("ignoring the field duo_test_only_field") == 1


def test_seed_minus_one_draws_a_fresh_seed_each_time(served_alone):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 1.0, "seed": -1}
    seeds = {post(served_alone, "/v1/completions", body).json()["duo_stats"]["seed"] for _ in range(3)}
    assert len(seeds) == 3


def test_ignore_eos_never_ends_the_answer_with_an_end_of_generation_token(served_alone, target_model):
    eos = target_model.vocab().eos
    likely_end = {"prompt": "hi", "n_predict": 6, "temperature": 0, "logit_bias": [[eos, 50]]}
    ended = post(served_alone, "/completion", likely_end).json()
    assert ended["stop_type"] == "eos" and ended["tokens_predicted"] < 6  # the bias makes it end at once
    ignored = post(served_alone, "/completion", {**likely_end, "ignore_eos": True}).json()
    assert ignored["stop_type"] == "limit" and ignored["tokens_predicted"] == 6
    assert not any(target_model.is_end_of_generation(token) for token in ignored["tokens"])


def test_a_prompt_past_the_context_is_llama_servers_overflow_error_and_openais(served_alone):
    for path, body in (("/v1/completions", {"prompt": " the" * (CONTEXT_SIZE + 10)}),
                       ("/completion", {"prompt": [1] * (CONTEXT_SIZE + 3)}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 10 ** 6}]})):
        response = post(served_alone, path, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "exceed_context_size_error" and error["code"] == "context_length_exceeded"
        assert error["n_ctx"] == CONTEXT_SIZE and error["n_prompt_tokens"] > CONTEXT_SIZE - 1, error
        assert "exceeds the available context size" in error["message"] and "--ctx-size" in error["message"]


# --- warm-ups ------------------------------------------------------------------------------------------------


def test_a_warm_up_reads_the_prompt_into_the_cache_for_the_request_that_follows(served_sync):
    prompt = "".join(f"def helper_{i}(value):\n    return value * {i} + {i * 7} - {i // 3}\n\n" for i in range(24))
    warm = post(served_sync, "/completion", {"prompt": prompt, "n_predict": 0, "cache_prompt": True}).json()
    assert warm["content"] == "" and warm["tokens"] == [] and warm["tokens_predicted"] == 0
    assert warm["tokens_evaluated"] > 100
    real = post(served_sync, "/completion", {"prompt": prompt + "def main():", "n_predict": 8,
                                             "temperature": 0}).json()
    assert real["tokens_cached"] >= warm["tokens_evaluated"] - 1  # all the warm prompt but its last cell at most
    assert real["timings"]["prompt_n"] < real["tokens_evaluated"] - 100
    events = streamed(served_sync, "/completion", {"prompt": prompt[:-10], "n_predict": 0}, done=False)
    assert len(events) == 1 and events[0]["stop"] is True and events[0]["content"] == ""
    assert math.isfinite(events[0]["timings"]["prompt_ms"])
