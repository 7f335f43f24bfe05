"""Liveness under churn (issue 9, "nothing leaks or stalls"): 200 requests from 4 concurrent clients,
greedy and sampled, streamed or not, over gRPC and HTTP, while the draft is killed (SIGKILL) and
restarted on the same port every few seconds. No request fails, every greedy answer is the target
alone's, and neither process grows: the target's memory after the churn, and a draft's after many
sessions, stay within 25% of what they were after a warm-up.

This is the slowest test of the suite (about a minute on 2 cores): it runs real processes for a while.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import pytest

from duo.llama.model import Model
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.processes import Process, generate, start, wait_for_draft

PROMPTS = ["def fibonacci(n):", "Once upon a time", "The quick brown fox", "import numpy as np\n",
           "Dear Sir or Madam,", "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", "1, 2, 3,",
           "In the beginning"]
MAX_TOKENS = 16
CLIENTS = 4
REQUESTS = 200
WARM_UP = 20
DRAFT_SESSIONS = 80  # after the draft's warm-up
KILL_EVERY = 20  # requests: the draft is killed each time this many more have finished (a few seconds)
MAX_GROWTH = 1.25


@dataclass(frozen=True)
class Call:
    """One request of the mix: request i cycles through every combination."""

    prompt: str
    grpc: bool
    greedy: bool
    stream: bool  # HTTP only: gRPC always streams

    @classmethod
    def number(cls, i: int) -> "Call":
        return cls(PROMPTS[i // 8 % len(PROMPTS)], grpc=i % 2 == 0, greedy=i // 2 % 2 == 0, stream=i // 4 % 2 == 0)


def rss_kib(process: Process) -> int:
    for line in Path(f"/proc/{process.popen.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {process.popen.pid}")


def http_text(process: Process, call: Call) -> str:
    body = {"prompt": call.prompt, "max_tokens": MAX_TOKENS, "temperature": 0 if call.greedy else 0.8,
            "stream": call.stream}
    url = f"{process.http_url}/v1/completions"
    if not call.stream:
        response = httpx.post(url, json=body, timeout=60)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]
    text, done = "", False
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                text += event["choices"][0]["text"]
    assert done, "the stream ended without [DONE]"
    return text


def answer(process: Process, call: Call) -> str | list[int]:
    """The greedy reference's kind of answer: token ids over gRPC, text over HTTP."""
    if call.grpc:
        tokens, last = generate(process.address, call.prompt, max_tokens=MAX_TOKENS,
                                temperature=0 if call.greedy else 0.8, timeout=60)
        assert last.finish_reason in ("length", "stop"), last
        return tokens
    return http_text(process, call)


def run_mix(process: Process, calls: list[Call], expected: dict[Call, str | list[int]], model: Model,
            on_done: Callable[[], None] = lambda: None) -> list[str]:
    """Run `calls` from CLIENTS threads; the failures, described (an empty list when all went well)."""
    def one(call: Call) -> str | None:
        try:
            got = answer(process, call)
        except Exception as error:  # any failure at all is what this test counts
            return f"{call}: {type(error).__name__}: {error}"
        finally:
            on_done()
        if call.greedy and got != expected[call] and not leaves_greedy_path_only_at_a_near_tie(
                model, call.prompt, got, MAX_TOKENS):
            return f"{call}: {got!r} is not the target alone's {expected[call]!r}"
        return None

    with ThreadPoolExecutor(CLIENTS) as pool:
        return [failure for failure in pool.map(one, calls) if failure]


class DraftKiller:
    """Kills the draft (SIGKILL) each time KILL_EVERY more requests have finished, and restarts it on the
    same port, until stopped: the kills land at whatever point the running generations have reached."""

    def __init__(self, draft: Process, tiny_draft: Path, log_dir: Path) -> None:
        self.draft = draft
        self.model = tiny_draft
        self.log_dir = log_dir
        self.port = int(draft.address.rsplit(":", 1)[1])
        self.kills = 0
        self.error: BaseException | None = None  # why a restart failed, raised by __exit__
        self._finished = 0
        self._stopped = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def request_done(self) -> None:
        with self._changed:
            self._finished += 1
            self._changed.notify()

    def __enter__(self) -> "DraftKiller":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()
        self._thread.join()
        if self.error:
            raise self.error

    def _run(self) -> None:
        try:
            self._kill_and_restart()
        except BaseException as error:  # the test thread raises it
            self.error = error

    def _kill_and_restart(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._stopped or self._finished >= (self.kills + 1) * KILL_EVERY)
                if self._stopped:
                    return
            self.draft.kill()
            self.kills += 1
            self.draft = start("duo.cli.draft", ["--model", str(self.model)], self.log_dir, port=self.port)


def spec_decode_drafts(process: Process) -> float:
    for line in httpx.get(f"{process.http_url}/metrics").text.splitlines():
        if line.startswith("duo:spec_decode_num_drafts_total "):
            return float(line.split()[1])
    raise AssertionError("no duo:spec_decode_num_drafts_total in /metrics")


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("churn-logs")


def test_churn_no_request_fails_greedy_answers_hold_and_memory_stays_flat(tiny_target, tiny_draft, log_dir,
                                                                          target_model):
    calls = [Call.number(i) for i in range(REQUESTS)]
    references = sorted({call for call in calls if call.greedy}, key=str)
    alone = start("duo.cli.target", ["--model", str(tiny_target)], log_dir, http=True)
    try:
        expected = {call: answer(alone, call) for call in references}
    finally:
        alone.stop()

    draft = start("duo.cli.draft", ["--model", str(tiny_draft)], log_dir)
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, "--draft-max", "4"],
                   log_dir, http=True)
    killer = DraftKiller(draft, tiny_draft, log_dir)
    try:
        wait_for_draft(target.address)
        assert run_mix(target, [Call.number(i) for i in range(WARM_UP)], expected, target_model) == []
        target_before = rss_kib(target)
        drafts_before = spec_decode_drafts(target)

        began = time.monotonic()
        with killer:
            failures = run_mix(target, calls, expected, target_model, on_done=killer.request_done)
        churn_s = time.monotonic() - began
        target_after = rss_kib(target)

        assert failures == [], f"{len(failures)} of {REQUESTS} requests failed:\n" + "\n".join(failures[:10])
        assert killer.kills >= REQUESTS // KILL_EVERY // 2, f"the draft was killed only {killer.kills} times"
        assert spec_decode_drafts(target) > drafts_before, "the draft took no part during the churn"
        assert target_after <= MAX_GROWTH * target_before, (target_before, target_after)

        # The last draft now lives on: its memory across many sessions.
        wait_for_draft(target.address)
        assert run_mix(target, [Call.number(i) for i in range(WARM_UP)], expected, target_model) == []
        draft_before = rss_kib(killer.draft)
        assert run_mix(target, calls[:DRAFT_SESSIONS], expected, target_model) == []
        draft_after = rss_kib(killer.draft)
        assert draft_after <= MAX_GROWTH * draft_before, (draft_before, draft_after)
        print(f"churn: {REQUESTS} requests in {churn_s:.1f} s, {killer.kills} draft kills; target RSS "
              f"{target_before} -> {target_after} KiB; draft RSS over {DRAFT_SESSIONS} sessions "
              f"{draft_before} -> {draft_after} KiB")
    finally:
        target.stop()
        killer.draft.stop()
