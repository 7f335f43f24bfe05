"""duo-target's OpenAI-compatible HTTP API, driven by the official `openai` client and by raw HTTP."""

from __future__ import annotations

import threading
import time
from contextlib import suppress

import grpc
import httpx
import openai
import pytest

from conftest import CONTEXT_SIZE
from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.http import (LEAVE_EARLY_TOKENS, client, generated_tokens, greedy_text, health, model_name, post, scrape,
                          sse_events, stop_inside, wait_until_idle)
from helpers.processes import generate, start

PROMPTS = ["def fibonacci(n):", "Once upon a time", "The quick brown fox", "import numpy as np\n",
           "Dear Sir or Madam,", "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", "1, 2, 3,",
           "In the beginning"]


# --- completions and chat ------------------------------------------------------------------------


def test_completions_answer_the_greedy_text_with_usage_and_duo_stats(served_alone, target_model):
    response = client(served_alone).completions.create(model=model_name(served_alone), prompt=PROMPTS[1],
                                                       max_tokens=16, temperature=0)
    choice = response.choices[0]
    assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPTS[1], choice.text, 16)
    assert choice.finish_reason == "length"
    assert response.object == "text_completion"
    with grpc.insecure_channel(served_alone.address) as channel:
        n_prompt = len(pb_grpc.TargetStub(channel).Tokenize(pb.TokenizeRequest(prompt=PROMPTS[1])).token_ids)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (n_prompt, 16)
    assert response.usage.total_tokens == n_prompt + 16
    stats = response.model_extra["duo_stats"]
    assert stats["generated_tokens"] == 16 and stats["verify_steps"] > 0


def test_chat_completions_render_the_messages_with_the_models_chat_template(served_alone, target_model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    request = pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in messages], max_tokens=12)
    with grpc.insecure_channel(served_alone.address) as channel:
        prompt = list(pb_grpc.TargetStub(channel).Tokenize(pb.TokenizeRequest(messages=request.messages)).token_ids)
    n_prompt = len(prompt)
    response = client(served_alone).chat.completions.create(model=model_name(served_alone), messages=messages,
                                                            max_completion_tokens=12, temperature=0)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, response.choices[0].message.content, 12)
    assert response.usage.prompt_tokens == n_prompt > 10  # the template adds role markers to the 4 text tokens


def test_a_chat_sharing_the_previous_ones_system_prompt_reports_that_prefix_as_cached(served_alone):
    system = {"role": "system", "content": "You are a careful assistant who answers in one short sentence."}
    first, second = ([system, {"role": "user", "content": text}] for text in ("hello", "what is a prime?"))
    with grpc.insecure_channel(served_alone.address) as channel:
        tokenize = pb_grpc.TargetStub(channel).Tokenize
        ids = [list(tokenize(pb.TokenizeRequest(messages=[pb.ChatMessage(**m) for m in chat])).token_ids)
               for chat in (first, second)]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert shared > 15  # the template's system turn and the start of the user's
    answers = [client(served_alone).chat.completions.create(model=model_name(served_alone), messages=chat,
                                                            max_tokens=8, temperature=0) for chat in (first, second)]
    assert answers[1].usage.prompt_tokens_details.cached_tokens == shared
    assert answers[1].model_extra["duo_stats"]["cached_prompt_tokens"] == shared
    assert answers[1].usage.prompt_tokens == len(ids[1])


def test_a_streamed_chat_adds_up_to_the_whole_answer_and_ends_with_usage(served_alone):
    messages = [{"role": "user", "content": "tell me a story"}]
    whole = client(served_alone).chat.completions.create(model=model_name(served_alone), messages=messages,
                                                         max_tokens=20, temperature=0)
    chunks = list(client(served_alone).chat.completions.create(
        model=model_name(served_alone), messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert finishing[0].model_extra["duo_stats"]["generated_tokens"] == 20
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_streamed_completion_is_server_sent_events_ending_in_done(served_alone, target_model):
    with httpx.stream("POST", f"{served_alone.http_url}/v1/completions", timeout=60,
                      json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = sse_events(response.iter_lines(), done=True)
    assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPTS[0], "".join(c["choices"][0]["text"] for c in chunks), 8)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_ends_the_completion_before_it_and_is_not_returned(served_alone):
    full = greedy_text(served_alone, PROMPTS[2], 40)
    stop = stop_inside(full)
    expected = full[:full.index(stop)]
    api = client(served_alone)
    response = api.completions.create(model=model_name(served_alone), prompt=PROMPTS[2], max_tokens=40,
                                      temperature=0, stop=[stop, "never appears"])
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < 40, "the target went on generating past the stop string"
    # Streamed, nothing of the stop string leaks out before it is recognised: it was held back.
    chunks = list(api.completions.create(model=model_name(served_alone), prompt=PROMPTS[2], max_tokens=40,
                                         temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_until_idle(served_alone)


def test_the_same_seed_gives_the_same_sample_on_a_target_without_a_draft(served_alone):
    api = client(served_alone)

    def sample(seed: int) -> str:
        return api.completions.create(model=model_name(served_alone), prompt=PROMPTS[1], max_tokens=24,
                                      temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (7, 8, 9)}) > 1, "different seeds should give different samples"


def test_with_a_draft_a_sampled_completion_is_still_complete_and_speculated(served_sync):
    # Unseeded: verified by residual rejection sampling (tests/target/test_coupled.py has the seeded ones).
    # The synchronous target waits for the draft at each step, so the draft takes part every time.
    response = client(served_sync).completions.create(model=model_name(served_sync), prompt=PROMPTS[1],
                                                      max_tokens=48, temperature=1.0)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 48 and response.choices[0].text
    stats = response.model_extra["duo_stats"]
    assert stats["draft_connected"] and stats["draft_tokens_verified"] > 0 and stats["verification"] == "residual"


def test_models_lists_the_served_model_with_llama_servers_meta_and_any_name_is_it(served_alone, tiny_target,
                                                                                  target_model):
    api = client(served_alone)
    listed = api.models.list().data
    assert [m.id for m in listed] == [tiny_target.stem]
    meta = listed[0].model_extra["meta"]
    assert meta["n_vocab"] == target_model.n_vocab and meta["n_ctx_train"] == target_model.n_ctx_train
    assert meta["n_params"] > 0 and meta["size"] > 0 and meta["n_embd"] > 0
    assert api.models.retrieve(tiny_target.stem).id == tiny_target.stem
    assert api.models.retrieve("gpt-4").id == "gpt-4"  # one model is served, whatever name a client gives it


# --- bad input -------------------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path, body, status, words, param", [
    ("/v1/completions", {"prompt": " the" * (CONTEXT_SIZE + 10)}, 400, ["context", "--ctx-size"], "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, ["max_tokens"], "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "temperature": 5}, 400, ["temperature", "between 0 and 2"], "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, ["top_p"], "top_p"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}', 400, ["not valid JSON"], None),
    ("/v1/chat/completions", "[1, 2]", 400, ["JSON object"], None),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, ["temperature", "number"], "temperature"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, ["messages"], "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, ["role"], "messages.0.role"),
    ("/v1/chat/completions", {"max_tokens": 2}, 400, ["messages", "required"], "messages"),
    ("/v1/chat/completions", {**CHAT, "n": 64}, 400, ["n must be between 1 and"], "n"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, 400, ["top_logprobs needs logprobs"], "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, ["logprobs"], "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, ["stop"], "stop"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, ["one prompt"], "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, ["empty"], "prompt"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, ["token ids"], "prompt"),
    ("/v1/completions", {"prompt": "hi", "seed": -2}, 400, ["seed"], "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     ["text parts"], "messages[0].content"),
    ("/v1/completions", '{"prompt": "\\ud800"}', 400, ["not valid Unicode"], "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, ["not valid Unicode"],
     "messages"),
    ("/v1/nothing", {}, 404, ["not part of this API"], None),
], ids=["prompt longer than the context", "negative max_tokens", "temperature out of range",
        "top_p zero", "malformed JSON", "not an object", "temperature not a number", "messages not a list",
        "unknown role", "no messages", "n above --parallel", "top_logprobs without logprobs", "completion logprobs above 20",
        "empty stop string", "several prompts", "empty prompt", "token id out of range", "negative seed",
        "image part", "lone surrogate in the prompt", "lone surrogate in a message", "unknown route"])
def test_bad_input_gets_a_4xx_saying_what_to_fix_and_the_server_keeps_serving(
        served_alone, path, body, status, words, param):
    response = post(served_alone, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    for word in words:
        assert word in error["message"], error
    assert error["param"] == param
    overflow = {"n_prompt_tokens", "n_ctx"} if error["code"] == "context_length_exceeded" else set()
    assert set(error) == {"message", "type", "param", "code"} | overflow
    ok = post(served_alone, "/v1/chat/completions", CHAT)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_the_openai_client_raises_its_bad_request_error_with_the_message(served_alone):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client(served_alone).chat.completions.create(model=model_name(served_alone), temperature=3,
                                                     messages=[{"role": "user", "content": "hi"}])


# --- health and metrics ------------------------------------------------------------------------------


def test_health_reports_the_model_the_draft_and_the_requests(served_alone, served_duo):
    alone = httpx.get(f"{served_alone.http_url}/health")
    assert alone.status_code == 200
    assert alone.json() == {"status": "ok", "model": "tiny-target", "draft": "none", "draft_error": "",
                            "draft_sessions": 0, "drafts": [], "requests_running": 0, "requests_waiting": 0}
    body = health(served_duo)
    assert body["draft"] == "connected" and body["draft_error"] == ""
    [draft] = body["drafts"]  # the one --peer, as the pool sees it
    assert draft["state"] == "connected" and draft["model"].startswith("tiny-draft") and draft["sessions"] == 0


def test_metrics_count_drafts_acceptance_tokens_and_requests_after_a_speculative_generation(served_sync):
    before = scrape(served_sync)
    response = client(served_sync).completions.create(model=model_name(served_sync), prompt=PROMPTS[0],
                                                     max_tokens=64, temperature=0)
    stats = response.model_extra["duo_stats"]
    after = scrape(served_sync)

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert stats["draft_tokens_verified"] > 0 and stats["draft_tokens_accepted"] > 0
    assert moved("duo:spec_decode_num_drafts_total") > 0
    assert moved("duo:spec_decode_num_draft_tokens_total") == stats["draft_tokens_verified"]
    assert moved("duo:spec_decode_num_accepted_tokens_total") >= stats["draft_tokens_accepted"]
    assert moved("duo:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    per_pos = sum(moved("duo:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(64))
    assert per_pos == moved("duo:spec_decode_num_accepted_tokens_total")
    assert moved("duo:generation_tokens_total") == 64
    assert moved("duo:prompt_tokens_total") == response.usage.prompt_tokens
    assert moved("duo:prompt_tokens_cached_total") == response.usage.prompt_tokens_details.cached_tokens
    assert moved("duo:request_success_total", finish_reason="length") == 1
    assert moved("duo:requests_by_verification_total", verification="greedy") == 1
    assert moved("duo:draft_tokens_accepted_by_verification_total", verification="greedy") == stats["draft_tokens_accepted"]
    assert moved("duo:e2e_request_latency_seconds_count") == 1
    assert moved("duo:time_to_first_token_seconds_count") == 1
    assert after[("duo:draft_connected", ())] == 1
    assert after[("duo:spec_decode_draft_len", ())] >= 0 and ("duo:spec_decode_gain", ()) in after
    assert after[("duo:spec_decode_on", ())] in (0.0, 1.0)
    assert after[("duo:num_requests_running", ())] == 0 and after[("duo:num_requests_waiting", ())] == 0


# --- concurrency, queueing, disconnects ---------------------------------------------------------------


def test_eight_concurrent_streaming_clients_each_get_their_own_greedy_output(served_duo, target_model):
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def work(prompt: str) -> None:
        try:
            stream = client(served_duo).completions.create(model=model_name(served_duo), prompt=prompt,
                                                           max_tokens=40, temperature=0, stream=True)
            results[prompt] = "".join(chunk.choices[0].text for chunk in stream)
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(p,)) for p in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    for prompt, text in results.items():  # batched requests round logits differently: near-ties aside
        assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, text, 40), prompt
    assert results.keys() == set(PROMPTS)
    wait_until_idle(served_duo)


@pytest.fixture(scope="module")
def one_at_a_time(tiny_target, process_logs):
    process = start("duo.cli.target", ["--model", str(tiny_target), "--parallel", "1", "--queue-size", "1"],
                    process_logs, http=True)
    yield process
    process.stop()


def wait_for(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def post_until_closed(http: httpx.Client, url: str, body: dict) -> None:
    """POST on a client that the test closes meanwhile (the request's client leaves)."""
    with suppress(httpx.TransportError):
        http.post(url, json=body)


def test_past_the_queue_bound_requests_get_503_and_resource_exhausted_and_leaving_frees_the_places(one_at_a_time):
    long = {"prompt": PROMPTS[1], "max_tokens": 3000, "temperature": 0, "stream": True}
    url = f"{one_at_a_time.http_url}/v1/completions"
    with httpx.Client(timeout=60) as running, httpx.Client(timeout=60) as waiting:
        with running.stream("POST", url, json=long) as first:
            lines = first.iter_lines()  # kept: dropping the iterator would close the response
            next(lines)  # it runs
            second = threading.Thread(target=post_until_closed, args=(waiting, url, long), daemon=True)
            second.start()
            wait_for(lambda: health(one_at_a_time)["requests_waiting"] == 1)

            refused = post(one_at_a_time, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "queue_full"
            assert "busy" in refused.json()["error"]["message"]
            with pytest.raises(grpc.RpcError) as exhausted:
                generate(one_at_a_time.address, "hi", max_tokens=2)
            assert exhausted.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        waiting.close()  # the queued client leaves too
        second.join(30)
    wait_until_idle(one_at_a_time)
    assert post(one_at_a_time, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_client_that_leaves_mid_stream_frees_its_session_and_the_drafts(served_duo):
    before = generated_tokens(served_duo)
    body = {"prompt": PROMPTS[0], "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served_duo.http_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert health(served_duo)["draft_sessions"] == 1
    wait_until_idle(served_duo)
    assert generated_tokens(served_duo) - before < LEAVE_EARLY_TOKENS


def test_a_client_that_leaves_before_a_whole_answer_frees_its_session(served_duo):
    before = generated_tokens(served_duo)
    body = {"prompt": PROMPTS[0], "max_tokens": 3000, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{served_duo.http_url}/v1/completions", json=body, timeout=0.5)
    wait_until_idle(served_duo)
    assert generated_tokens(served_duo) - before < LEAVE_EARLY_TOKENS


def test_a_grpc_client_that_cancels_frees_its_session(served_duo):
    before = generated_tokens(served_duo)
    request = pb.GenerateRequest(prompt=PROMPTS[0], max_tokens=3000)
    with grpc.insecure_channel(served_duo.address) as channel:
        call = pb_grpc.TargetStub(channel).Generate(request, timeout=60)
        next(call)
        next(call)
        call.cancel()
    wait_until_idle(served_duo)
    assert generated_tokens(served_duo) - before < LEAVE_EARLY_TOKENS


def test_a_request_with_cache_prompt_false_neither_reuses_nor_leaves_a_prefix_for_others(served_alone):
    system = {"role": "system", "content": "Terse mode: never explain any answer, whatever the user asks."}
    chats = [[system, {"role": "user", "content": text}] for text in ("name a color", "name a fruit", "name a tree")]

    def cached(chat: list[dict], **extra) -> int:
        answer = client(served_alone).chat.completions.create(model=model_name(served_alone), messages=chat,
                                                              max_tokens=4, temperature=0, extra_body=extra)
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached(chats[0], cache_prompt=False) == 0  # takes nothing
    assert cached(chats[1], cache_prompt=False) == 0
    # Neither left its system prompt for a request that does share: it finds at most the template's
    # opening that other tests' requests left.
    assert cached(chats[2]) < 6
    assert cached(chats[0]) > 15  # ... which now leaves its prefix for the next one
