"""A hostile pool beside honest streams (issue 49): while a draft that joined honestly speculates four greedy streams,
a dishonest joiner, a 64 MB Hello, a 1 MB model name and the bodies of issues 40 and 49 go in. Every stream follows
the target alone with drafts accepted; every bad body gets a 4xx of its API's shape and every heavy one an answer
(never a 5xx); /health answers quickly throughout; no place or session is lost; memory and what is served stay
bounded."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from duo.net.listening import free_port
from helpers import hostile_joiner
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.processes import start, wait_for_draft
from helpers.hostile import HEALTH_BUDGET_S, RSS_GROWTH_MB, HealthWatch, rss_mb, worst_health
from helpers.hostile import bad_bodies as first_soak_bodies

# /health is timed against HEALTH_BUDGET_S under this test's own load: run alone (scripts/test.sh).
pytestmark = pytest.mark.serial

ROUNDS = 2  # of the bodies, at least; they go on while the streams run (at most HOSTILE_S)
HOSTILE_S = 60.0
MAX_TOKENS = 48
PROMPTS = [f"def f{i}(x):\n    return" for i in range(4)]
SERVED_STRING = 256  # the longest peer-given string /health, /props or /metrics may repeat


def chat(**fields) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields})


def issue_49_bad_bodies() -> list[tuple[str, str]]:
    """(path, raw body) of issue 49's items 3, 4 and 5 that must be refused."""
    many_items = [{"type": "message", "role": "user", "content": "x"}] * 135_000
    long_id = [{"type": "function_call", "call_id": "c" * 4_000_000, "name": "f", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c" * 4_000_000, "output": "42"}]
    return [
        ("/v1/responses", json.dumps({"input": [{"type": "message", "role": "user", "content": "x"}] * 3000})),  # 3
        ("/v1/responses", json.dumps({"input": many_items})),  # 3: 135,000 items
        ("/v1/chat/completions", json.dumps({"max_tokens": 4, "messages": [  # 3: content parts at depth 3
            {"role": "user", "content": [{"type": "text", "text": "x"}] * 135_000}]})),
        ("/v1/messages", json.dumps({"model": "m", "max_tokens": 4, "messages": [  # 3: content blocks
            {"role": "user", "content": [{"type": "text", "text": "x"}] * 135_000}]})),
        ("/v1/responses", json.dumps({"input": long_id})),  # 4: an id no template renders
        ("/completion", json.dumps({"prompt": "hi", "n_predict": 4, "dry_multiplier": 0.8,  # 5: beyond the bound
                                    "dry_sequence_breakers": [f"b{i}" for i in range(1000)]})),
    ]


def unknown_fields_body() -> str:
    """Issue 49's item 7: four 1 MB field names, ignored (4 MB to build: made before the clock runs, as the bad
    bodies are; building it in the watch's process held its GIL, and /health's time with it)."""
    return json.dumps({"prompt": "hi", "n_predict": 1, **{f"{i}{'n' * 1_000_000}": 1 for i in range(4)}})


def heavy_bodies(unknown: str) -> list[tuple[str, str]]:
    """(path, raw body) of issue 49's items 5-7 and 9 that are a client's right: each gets an answer, not a 5xx.
    `unknown`: unknown_fields_body()."""
    # Qwen's <tool_call> named as its token (as duo's own tool grammars do), then a long argument in many pieces.
    forced_call = 'start: <[151657]> "\\n{\\"name\\": \\"f\\", \\"arguments\\": {\\"a\\": \\"" /x{2000}/'
    return [
        ("/completion", json.dumps({"prompt": " ha" * 1500, "n_predict": 4, "dry_multiplier": 0.8})),  # 5: window
        ("/completion", json.dumps({"prompt": "hi", "n_predict": 4, "dry_multiplier": 0.8,  # 5: a new list each time
                                    "dry_sequence_breakers": [f"{time.monotonic_ns()}-{i}" for i in range(16)]})),
        ("/completion", json.dumps({"prompt": "hi", "n_predict": 8, "mirostat": 2, "mirostat_tau": -1e6,  # 6
                                    "mirostat_eta": 1e6})),
        ("/v1/chat/completions", chat(mirostat=1, mirostat_tau=1e6, mirostat_eta=1e6)),  # 6
        ("/completion", unknown),  # 7
        ("/v1/chat/completions", chat(max_tokens=400, stream=True, grammar=forced_call,  # 9: a call streamed in pieces
                                      tools=[{"type": "function", "function": {"name": "f", "parameters": {
                                          "type": "object", "properties": {"a": {"type": "string"}}}}}])),
    ]


def stream(url: str, prompt: str) -> tuple[str, dict]:
    """A greedy streamed completion: its text, and its last chunk (duo_stats, finish reason)."""
    text, last = [], {}
    with httpx.stream("POST", f"{url}/v1/completions", timeout=180,
                      json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line.removeprefix("data: "))
                text.append(last["choices"][0]["text"])
    return "".join(text), last


def post(url: str, path: str, raw: str) -> tuple[int, bool, str, bool]:
    """Status, whether a 4xx came in its API's error shape, the answer's head, and whether a stream it began ended
    in an error event."""
    response = httpx.post(f"{url}{path}", content=raw, timeout=120, headers={"Content-Type": "application/json"})
    shaped = False
    if response.headers.get("content-type", "").startswith("application/json"):
        answer = response.json()
        shaped = "error" in answer if path != "/v1/messages" else answer.get("type") == "error"
    streamed_error = response.headers.get("content-type", "").startswith("text/event-stream") and any(
        line.startswith("data: {\"error\"") for line in response.text.splitlines())
    return response.status_code, shaped, response.text[:300], streamed_error


def in_flight(posted: list[tuple[float, str]], at: float) -> str:
    """The body posted last before unix time `at` (posted: (time, what) in order)."""
    return next((what for when, what in reversed(posted) if when <= at), "")


def longest_served_string(value) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        value = list(value.values()) + list(value)
    return max((longest_served_string(item) for item in value), default=0) if isinstance(value, list) else 0


def test_a_hostile_pool_and_client_beside_an_honest_joined_draft_stall_and_change_nothing(
        tiny_target, tiny_draft, target_model, process_logs):
    pool_port = free_port()
    target = start("duo.cli.target", ["--model", str(tiny_target), "--draft-listen", f"127.0.0.1:{pool_port}",
                                      "--draft-max", "4", "--parallel", "6", "--queue-size", "16"],
                   process_logs, http=True)
    honest = start("duo.cli.draft", ["--model", str(tiny_draft), "--join", f"127.0.0.1:{pool_port}"], process_logs)
    joiner: subprocess.Popen | None = None
    watch: HealthWatch | None = None
    url = target.http_url
    try:
        wait_for_draft(target.address)
        stream(url, "warm up")
        before = httpx.get(f"{url}/health").json()
        answers, heavy, rss, done = [], [], [], threading.Event()
        posted: list[tuple[float, str]] = []  # (unix time, path and head) of each body as it goes in
        watch = HealthWatch(url)

        bad = first_soak_bodies() + issue_49_bad_bodies()  # made before the clock runs (they hold this GIL)
        unknown = unknown_fields_body()
        # Its own process: building and sending a 64 MB Hello would hold this one's GIL, and the watch with it.
        joiner = subprocess.Popen([sys.executable, hostile_joiner.__file__,
                                   f"127.0.0.1:{pool_port}", str(tiny_target)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        def hostile() -> None:
            deadline, rounds = time.monotonic() + HOSTILE_S, 0
            while rounds < ROUNDS or not done.is_set() and time.monotonic() < deadline:
                for path, raw in bad:
                    posted.append((time.time(), f"{path} {raw[:60]}"))
                    answers.append((path, raw[:60], *post(url, path, raw)))
                for path, raw in heavy_bodies(unknown):
                    posted.append((time.time(), f"{path} {raw[:60]}"))
                    heavy.append((path, raw[:60], *post(url, path, raw)))
                rounds += 1
                rss.append(rss_mb(target.popen.pid))

        with ThreadPoolExecutor(8) as pool:
            began, attacker = time.time(), pool.submit(hostile)
            # The attack is under way, and the dishonest draft in the pool, before the streams start.
            deadline = time.monotonic() + 30
            while target.log().count("joined the pool") < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            streams = [pool.submit(stream, url, prompt) for prompt in PROMPTS]
            finals = [future.result() for future in streams]
            done.set()
            attacker.result()
            ended = time.time()
        samples = watch.stop()
        outcomes = json.loads(joiner.communicate(input="", timeout=60)[0])
        after = httpx.get(f"{url}/health").json()
        served = [after, httpx.get(f"{url}/props").json(), httpx.get(f"{url}/metrics").text]
        rss.append(rss_mb(target.popen.pid))
        alive = target.popen.poll() is None and honest.popen.poll() is None
    finally:
        if joiner is not None:
            joiner.kill()
        if watch is not None:
            watch.kill()
        target.stop()
        honest.stop()
    assert alive
    wrong = [answer for answer in answers if not (400 <= answer[2] < 500 and answer[3])]
    assert not wrong, wrong
    failed = [answer for answer in heavy if answer[2] >= 500 or answer[2] >= 400 and not answer[3] or answer[5]]
    assert not failed, failed
    for prompt, (text, final) in zip(PROMPTS, finals):
        assert final["choices"][0]["finish_reason"] == "length", final
        assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, text, MAX_TOKENS), prompt
    assert sum(final["duo_stats"]["draft_tokens_accepted"] for _, final in finals) > 0
    assert outcomes[0] == "RESOURCE_EXHAUSTED", outcomes  # the 64 MB Hello is refused unread
    worst = worst_health(samples, began, ended)
    slow = [(round(took, 3), in_flight(posted, asked), in_flight(posted, asked + took))
            for asked, took, _ in samples if took >= HEALTH_BUDGET_S]
    assert worst < HEALTH_BUDGET_S, f"/health took {worst:.3f} s at worst; slow ones, bodies in flight: {slow}"
    assert (after["requests_running"], after["requests_waiting"]) == \
        (before["requests_running"], before["requests_waiting"]) == (0, 0)
    assert after["draft_sessions"] == before["draft_sessions"] == 0
    assert longest_served_string(served[0]["drafts"]) <= SERVED_STRING
    assert longest_served_string(served[1]["duo"]["drafts"]) <= SERVED_STRING
    assert max(len(line) for line in served[2].splitlines()) < 2 * SERVED_STRING + 200
    assert rss[-1] - rss[0] < RSS_GROWTH_MB, rss
    print(f"worst /health {worst * 1000:.0f} ms over {len(answers)} bad and {len(heavy)} heavy bodies; "
          f"joiner {outcomes[:4]}; RSS after each round {rss} MB")
