"""A hostile client beside honest ones (issue 40): while four streams speculate with the draft attached, a loop of
the bodies that used to wedge or stall the server goes in. Every bad body gets a 4xx of its API's shape, every stream
completes with drafts accepted, /health answers quickly throughout, no place or sequence is lost, memory stays put."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers.hostile import HEALTH_BUDGET_S, RSS_GROWTH_MB, HealthWatch, bad_bodies, rss_mb, worst_health
from helpers.processes import start, wait_for_draft

# /health is timed against HEALTH_BUDGET_S under this test's own load: run alone (scripts/test.sh).
pytestmark = pytest.mark.serial

ROUNDS = 3  # of the bad bodies, at least; they go on while the streams run (at most HOSTILE_S)
HOSTILE_S = 60.0
def stream(url: str, prompt: str) -> dict:
    """A greedy streamed completion; its last chunk's duo_stats and finish reason."""
    last: dict = {}
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": 48, "temperature": 0, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line.removeprefix("data: "))
    return last


def test_a_hostile_client_beside_four_streams_gets_4xx_and_stalls_nothing(tiny_target, tiny_draft, process_logs):
    draft = start("duo.cli.draft", ["--model", str(tiny_draft)], process_logs)
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, "--draft-max", "4",
                                      "--parallel", "6", "--queue-size", "16"], process_logs, http=True)
    url = target.http_url
    watch: HealthWatch | None = None
    try:
        wait_for_draft(target.address)
        stream(url, "warm up")
        before = httpx.get(f"{url}/health").json()
        answers, done, rss = [], threading.Event(), []
        watch = HealthWatch(url)
        bodies = bad_bodies()  # made before the clock runs: building megabytes of JSON here holds this process's GIL

        def hostile() -> None:
            deadline, rounds = time.monotonic() + HOSTILE_S, 0
            while rounds < ROUNDS or not done.is_set() and time.monotonic() < deadline:
                for path, raw in bodies:
                    response = httpx.post(f"{url}{path}", content=raw, timeout=60,
                                          headers={"Content-Type": "application/json"})
                    shaped = response.headers.get("content-type") == "application/json" and "error" in response.json()
                    answers.append((path, raw[:60], response.status_code, shaped, response.text[:300]))
                rounds += 1
                rss.append(rss_mb(target.popen.pid))

        time.sleep(0.5)  # the watch is under way before the attack
        with ThreadPoolExecutor(6) as pool:
            began, attacker = time.time(), pool.submit(hostile)
            time.sleep(0.5)  # the attack is under way before the streams start
            streams = [pool.submit(stream, url, f"def f{i}(x):\n    return") for i in range(4)]
            finals = [future.result() for future in streams]
            done.set()
            attacker.result()
            ended = time.time()
        worst = worst_health(watch.stop(), began, ended)
        after = httpx.get(f"{url}/health").json()
        rss.append(rss_mb(target.popen.pid))
    finally:
        if watch is not None:
            watch.kill()
        target.stop()
        draft.stop()
    wrong = [answer for answer in answers if not (400 <= answer[2] < 500 and answer[3])]
    assert not wrong, wrong
    assert all(final["choices"][0]["finish_reason"] == "length" for final in finals), finals
    assert sum(final["duo_stats"]["draft_tokens_accepted"] for final in finals) > 0
    assert worst < HEALTH_BUDGET_S, f"/health took {worst:.3f} s at worst"
    assert (after["requests_running"], after["requests_waiting"], after["draft_sessions"]) == \
        (before["requests_running"], before["requests_waiting"], before["draft_sessions"]) == (0, 0, 0)
    assert rss[-1] - rss[0] < RSS_GROWTH_MB, rss
    print(f"worst /health {worst * 1000:.0f} ms over {len(answers)} bad bodies; RSS after each round {rss} MB")
