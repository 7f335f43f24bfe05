"""A body that leaves the sampling fields out samples with llama-server's defaults (temperature 0.8, top_k 40, top_p
0.95, min_p 0.05: common.h's, which llama-server's /props reports), on every API, not with OpenAI's untruncated
temperature 1: a client that sends no temperature (every coding agent) gets from duo the distribution llama-server
gives it. The launch line's flags replace them one by one (tests/api/test_launch_flags_served.py). Likewise a
/v1/completions body without max_tokens generates until the end, as llama-server's, not OpenAI's 16 tokens."""

from __future__ import annotations

import httpx
import pytest

from duo.api.serving.defaults import LLAMA_SERVER_SAMPLING
from conftest import CONTEXT_SIZE
from helpers.http import post

PROMPT = "def fibonacci(n):"
LLAMA_SERVER = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama.cpp's common_params_sampling
OPENAI = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}  # untruncated, temperature 1
SEEDS = (1, 2, 3, 4)


def completion(served, seed: int, **fields) -> dict:
    body = {"prompt": PROMPT, "n_predict": 12, "ignore_eos": True, "seed": seed, **fields}
    response = post(served, "/completion", body)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_defaults_are_llama_servers():
    assert LLAMA_SERVER_SAMPLING == LLAMA_SERVER


def test_props_reports_llama_servers_defaults(served_alone):
    params = httpx.get(f"{served_alone.http_url}/props").json()["default_generation_settings"]["params"]
    assert {name: params[name] for name in LLAMA_SERVER} == pytest.approx(LLAMA_SERVER)


def test_a_body_without_sampling_fields_samples_as_one_sending_llama_servers_defaults(served_alone):
    for seed in SEEDS:
        left_out = completion(served_alone, seed)
        assert left_out["content"] == completion(served_alone, seed, **LLAMA_SERVER)["content"]
        settings = left_out["generation_settings"]
        assert {name: settings[name] for name in LLAMA_SERVER} == pytest.approx(LLAMA_SERVER)
    # Not as OpenAI's defaults would: on the tiny model's flat distribution, truncating to 40 tokens changes the draw.
    untruncated = [completion(served_alone, seed, **OPENAI)["content"] for seed in SEEDS]
    assert untruncated != [completion(served_alone, seed)["content"] for seed in SEEDS]


def test_chat_without_sampling_fields_samples_with_the_same_defaults(served_alone):
    """(Anthropic's and the Responses API's bodies carry no seed to compare draws by; their chats are filled by the same
    Answering.fill_defaults, and tests/api/test_launch_flags_served.py shows a launch line's default reaching them.)"""
    messages = [{"role": "user", "content": "hi"}]
    for seed in SEEDS[:2]:
        chat = {"messages": messages, "max_tokens": 12, "seed": seed, "ignore_eos": True}
        left_out = post(served_alone, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
        sent = post(served_alone, "/v1/chat/completions", {**chat, **LLAMA_SERVER}).json()
        assert left_out == sent["choices"][0]["message"]["content"]


def test_a_response_repeats_the_temperature_and_top_p_it_ran_with(served_alone):
    body = {"input": "hi", "max_output_tokens": 4}
    echoed = post(served_alone, "/v1/responses", body).json()
    assert (echoed["temperature"], echoed["top_p"]) == pytest.approx((0.8, 0.95))
    own = post(served_alone, "/v1/responses", {**body, "temperature": 0.3, "top_p": 0.5}).json()
    assert (own["temperature"], own["top_p"]) == pytest.approx((0.3, 0.5))


def test_completions_without_max_tokens_run_to_the_end_of_the_context_as_llama_servers(served_alone):
    answer = post(served_alone, "/v1/completions", {"prompt": PROMPT, "ignore_eos": True, "temperature": 0}).json()
    usage = answer["usage"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT_SIZE, usage
