"""llama-server's native endpoints, replayed as scripts written for llama.cpp (Continue's llama.cpp provider,
llama.vim/llama.vscode's warm-up, tokenizer scripts) send them: /completion, /tokenize, /detokenize,
/apply-template, /props; n_predict and max_tokens -1."""

from __future__ import annotations

import httpx

from conftest import CONTEXT_SIZE
from helpers.http import greedy_text, post, streamed

PROMPT = "def fibonacci(n):"


def test_completion_answers_content_with_llama_servers_fields_and_drafts(served_sync):
    # Continue's llama.cpp provider: prompt, n_predict, its sampling fields at their neutral values, stream false.
    response = post(served_sync, "/completion", {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "top_k": 0,
                                                 "top_p": 1.0, "min_p": 0.0, "cache_prompt": True, "stop": []})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["content"] == greedy_text(served_sync, PROMPT, 24) and len(body["tokens"]) == 24
    assert body["stop"] is True and body["stop_type"] == "limit" and body["tokens_predicted"] == 24
    timings = body["timings"]
    assert timings["predicted_n"] == 24 and timings["predicted_per_second"] > 0
    assert 0 < timings["draft_n_accepted"] <= timings["draft_n"]


def test_a_streamed_completion_is_json_events_ending_with_stop_and_no_done(served_alone):
    events = streamed(served_alone, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0}, done=False)
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == greedy_text(served_alone, PROMPT, 16)
    assert events[-1]["stop_type"] == "limit" and events[-1]["timings"]["predicted_n"] == 16


def test_a_stop_string_says_word_and_a_warm_up_generates_nothing(served_alone):
    text = greedy_text(served_alone, PROMPT, 16)
    stop = text.split()[2]
    body = post(served_alone, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                                              "stop": [stop]}).json()
    assert body["stop_type"] == "word" and stop not in body["content"]
    warm = post(served_alone, "/completion", {"prompt": PROMPT, "n_predict": 0})
    assert warm.status_code == 200 and warm.json()["content"] == "" and warm.json()["tokens_predicted"] == 0


def test_max_tokens_minus_one_and_n_predict_run_as_llama_server_reads_them(served_alone):
    prompt_tokens = post(served_alone, "/tokenize", {"content": PROMPT, "add_special": True}).json()["tokens"]
    whole = post(served_alone, "/v1/completions", {"prompt": PROMPT, "max_tokens": -1, "temperature": 0}).json()
    assert whole["choices"][0]["finish_reason"] in ("length", "stop")
    assert whole["usage"]["completion_tokens"] == CONTEXT_SIZE - len(prompt_tokens) or \
        whole["choices"][0]["finish_reason"] == "stop"  # until the context is full (or the model ends)
    aliased = post(served_alone, "/v1/completions", {"prompt": PROMPT, "n_predict": 5, "temperature": 0}).json()
    assert aliased["usage"]["completion_tokens"] == 5  # n_predict, not the 16 of OpenAI's default
    zero = post(served_alone, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 0}).json()  # a warm-up, as llama-server's
    assert zero["choices"][0]["message"]["content"] == "" and zero["usage"]["completion_tokens"] == 0
    assert zero["usage"]["prompt_tokens"] > 0 and zero["choices"][0]["finish_reason"] == "length"


def test_tokenize_detokenize_and_apply_template_agree_with_the_model(served_alone, target_model):
    tokens = post(served_alone, "/tokenize", {"content": "Hello <|im_end|> wörld"}).json()["tokens"]
    assert tokens == target_model.tokenize("Hello <|im_end|> wörld", add_special=False)
    pieces = post(served_alone, "/tokenize", {"content": "wörld", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] if isinstance(p["piece"], str) else bytes(p["piece"]).decode(errors="replace")
                   for p in pieces).endswith("rld") and [p["id"] for p in pieces] == target_model.tokenize(
                       "wörld", add_special=False)
    assert post(served_alone, "/detokenize", {"tokens": tokens}).json()["content"] == "Hello  wörld"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert post(served_alone, "/apply-template", {"messages": messages}).json()["prompt"] == \
        target_model.chat_prompt(messages)
    bad = post(served_alone, "/detokenize", {"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_props_say_the_model_the_context_and_the_draft(served_duo, tiny_target):
    props = httpx.get(f"{served_duo.http_url}/props").json()
    assert props["model_alias"] == tiny_target.stem and props["model_path"].endswith(tiny_target.name)
    assert props["default_generation_settings"]["n_ctx"] > 0 and "<|im_start|>" in props["chat_template"]
    assert props["duo"]["draft"] == "connected" and props["total_slots"] >= 1


def test_a_native_field_llama_server_reads_and_duo_cannot_honour_is_refused_by_name_unless_it_asks_nothing(
        served_alone):
    response = post(served_alone, "/completion", {"prompt": PROMPT, "n_predict": 4, "lora": [{"id": 0, "scale": 1}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora"
    off = {"lora": [], "post_sampling_probs": False, "repeat_penalty": 1.0, "n_probs": 0}  # as scripts send them
    assert post(served_alone, "/completion", {"prompt": PROMPT, "n_predict": 4, **off}).status_code == 200
