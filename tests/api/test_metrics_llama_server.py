"""/metrics as llama-server answers it (its tools/server/tests/unit/test_metrics.py): 501 unless started with
--metrics, the Process-Start-Time-Unix header, and its llamacpp:* counters and gauges, named, typed, described and
counted as it counts them, beside duo's own."""

from __future__ import annotations

import time

import httpx
import pytest

from duo.api.http.launch import LaunchSettings
from duo.api.serving.metrics import Metrics
from duo.cli.llama_launch import launch_settings
from duo.target.request import GenerationStats, StepRecord
from helpers.asgi import asgi_call, unloaded_app
from helpers.flags import target_flags

COUNTERS = ["prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
            "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total", "spec_decode_num_drafts_total"]
GAUGES = ["prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing", "requests_deferred",
          "n_busy_slots_per_decode"]


def llamacpp(text: str) -> dict[str, tuple[str, float]]:
    """The unlabelled llamacpp:* samples as the suite reads them: {name: (its # TYPE, value)}; every sample has a
    TYPE line of its own name."""
    types, values = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("llamacpp:") and "{" not in line:
            name, value = line.split(" ", 1)
            values[name.removeprefix("llamacpp:")] = (types[name], float(value))
    return values


def finished(prompt: int, cached: int, generated: int, *, prompt_s: float, generation_s: float) -> GenerationStats:
    """A request that read `prompt` tokens (`cached` of them from the cache) in `prompt_s`, then generated."""
    return GenerationStats(prompt_tokens=prompt, cached_prompt_tokens=cached, generated_tokens=generated,
                           started=100.0, arrived=99.0, first_token_at=100.0 + prompt_s,
                           finished_at=100.0 + prompt_s + generation_s)


def test_every_counter_and_gauge_has_llama_servers_name_type_and_help_line():
    metrics = Metrics()
    metrics.request_finished(finished(8, 0, 4, prompt_s=0.1, generation_s=0.3), "length")
    text = metrics.render().decode()
    found = llamacpp(text)
    assert {name: found[name][0] for name in COUNTERS + GAUGES} == \
        {**dict.fromkeys(COUNTERS, "counter"), **dict.fromkeys(GAUGES, "gauge")}
    assert all(f"# HELP llamacpp:{name} " in text for name in COUNTERS + GAUGES)
    assert "duo:generation_tokens_total 4.0" in text  # duo's own stay beside them


def test_prompt_tokens_count_those_decoded_apart_from_the_cached_and_generation_counts_every_token():
    metrics = Metrics()
    metrics.request_finished(finished(10, 0, 8, prompt_s=0.5, generation_s=1.0), "length")
    metrics.request_finished(finished(10, 9, 4, prompt_s=0.25, generation_s=0.5), "stop")
    found = llamacpp(metrics.render().decode())
    assert found["prompt_tokens_total"][1] == 11 and found["prompt_tokens_cached_total"][1] == 9
    assert found["tokens_predicted_total"][1] == 12 and found["n_tokens_max"][1] == 18
    assert found["prompt_seconds_total"][1] == pytest.approx(0.75)
    assert found["tokens_predicted_seconds_total"][1] == pytest.approx(1.5)


def test_the_rates_count_decode_steps_over_the_window_since_the_last_scrape():
    metrics = Metrics()
    metrics.request_finished(finished(10, 2, 8, prompt_s=0.5, generation_s=1.0), "length")
    first = llamacpp(metrics.render().decode())
    assert first["prompt_tokens_seconds"][1] == pytest.approx(8 / 0.5)
    assert first["predicted_tokens_seconds"][1] == pytest.approx(7 / 1.0)  # the first token came with the prompt
    again = llamacpp(metrics.render().decode())
    assert again["prompt_tokens_seconds"][1] == 0 and again["predicted_tokens_seconds"][1] == 0
    assert again["tokens_predicted_total"][1] == 8  # the counters go on


def test_model_calls_busy_slots_and_speculation_are_counted_as_llama_server_counts_them():
    metrics = Metrics()
    metrics.on_call(2, 9)
    metrics.on_call(1, 4)
    metrics.on_step(StepRecord(batch_size=4, n_verified=3, n_accepted=2, n_committed=3, seconds=0.01))
    metrics.on_step(StepRecord(batch_size=1, n_verified=0, n_accepted=0, n_committed=1, seconds=0.01))  # alone
    metrics.on_step(StepRecord(batch_size=2, n_verified=1, n_accepted=1, n_committed=2, seconds=0.01))
    text = metrics.render().decode()
    found = llamacpp(text)
    assert found["n_decode_total"][1] == 2 and found["n_busy_slots_per_decode"][1] == 1.5
    assert found["spec_decode_num_drafts_total"][1] == 2
    assert found["spec_decode_num_draft_tokens_total"][1] == 4
    assert found["spec_decode_num_accepted_tokens_total"][1] == 3
    assert 'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 2' in text
    assert 'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1' in text


def test_requests_processing_and_deferred_are_the_running_and_the_waiting():
    metrics = Metrics()
    assert llamacpp(metrics.render().decode())["requests_processing"][1] == 0  # the model still loading
    metrics.watch(draft_state=lambda: "none", draft_len=lambda: 0.0, spec_on=lambda: 0.0, spec_gain=lambda: 0.0,
                  running=lambda: 3.0, waiting=lambda: 2.0)
    found = llamacpp(metrics.render().decode())
    assert found["requests_processing"][1] == 3 and found["requests_deferred"][1] == 2


def test_without_the_metrics_flag_metrics_answer_501_in_llama_servers_words():
    answer = asgi_call(unloaded_app(launch=LaunchSettings()), "GET", "/metrics")
    assert answer.status_code == 501
    assert answer.json()["error"]["message"] == "This server does not support metrics endpoint. Start it with " \
                                                "`--metrics`"


def test_with_the_metrics_flag_metrics_carry_the_process_start_time_named_as_llama_server_writes_it():
    before = int(time.time())
    answer = asgi_call(unloaded_app(launch=LaunchSettings(metrics=True)), "GET", "/metrics")
    headers = {name.decode(): value.decode() for name, value in answer.headers.raw}
    assert answer.status_code == 200 and before - 1 <= int(headers["Process-Start-Time-Unix"]) <= time.time()
    assert "llamacpp:n_decode_total 0" in answer.text


@pytest.mark.parametrize("line, on_http, own_port", [("", False, None), ("--metrics", True, ""),
                                                     ("--metrics 127.0.0.1:9100", True, "127.0.0.1:9100")])
def test_metrics_flag_turns_metrics_on_at_the_http_port_and_with_an_address_there_too(line, on_http, own_port):
    args = target_flags(line)
    assert launch_settings(args).metrics is on_http and args.metrics == own_port


def native_completion(process, prompt: str, n_predict: int) -> dict:
    answer = httpx.post(f"{process.http_url}/completion", json={"prompt": prompt, "n_predict": n_predict},
                        timeout=120)
    assert answer.status_code == 200
    return answer.json()["timings"]


def test_served_counters_add_up_the_answers_timings_with_a_draft_attached(served_sync):
    before = llamacpp(httpx.get(f"{served_sync.http_url}/metrics").text)
    timings = [native_completion(served_sync, "the quick brown fox jumps over the lazy dog", n) for n in (1, 4, 16)]
    timings.append(native_completion(served_sync, "the quick brown fox jumps over the lazy dog", 4))  # cached
    after = llamacpp(httpx.get(f"{served_sync.http_url}/metrics").text)

    def moved(name: str) -> float:
        return after[name][1] - before[name][1]

    assert timings[-1]["cache_n"] > 0
    assert moved("prompt_tokens_total") == sum(t["prompt_n"] for t in timings)
    assert moved("prompt_tokens_cached_total") == sum(t["cache_n"] for t in timings)
    assert moved("tokens_predicted_total") == sum(t["predicted_n"] for t in timings)
    assert moved("spec_decode_num_draft_tokens_total") == sum(t["draft_n"] for t in timings) > 0
    # A step counts what it accepted; an answer, what it kept before its limit.
    assert moved("spec_decode_num_accepted_tokens_total") >= sum(t["draft_n_accepted"] for t in timings)
    assert moved("n_decode_total") > 0 and after["requests_processing"][1] == 0
