"""A soak: bursts of requests with idle stretches longer than the draft's stall limit between them, speculation on:
no reconnection, no failed request (a quiet link is not a stalled reader)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from helpers.processes import free_port, generate, start, wait_for_draft
from helpers.draft_servicer import scrape

IDLE_S = 40.0  # longer than duo-draft's OUTBOX_STALL_S (30 s): the link sends nothing meanwhile
LONG_PROMPT = "def f(x):\n" + "    x = x + 1\n" * 120  # ~700 tokens: the draft catches up in several rounds


def burst(address: str) -> list[int]:
    """Long prompts and short ones at once: the draft's first rounds after the idle stretch queue chunks for
    several of one target's sessions back to back."""
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(generate, address, LONG_PROMPT + "#" * i, max_tokens=48) for i in range(3)]
        futures += [pool.submit(generate, address, f"print({i})", max_tokens=24) for i in range(3)]
        return [len(future.result()[0]) for future in futures]


def test_bursts_after_idle_minutes_keep_the_link_and_fail_nothing(tiny_target, tiny_draft, process_logs):
    metrics_port = free_port()
    draft = start("duo.cli.draft", ["--model", str(tiny_draft), "--metrics", str(metrics_port)], process_logs)
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, "--draft-max", "4",
                                      "--ctx-size", "2048"], process_logs)
    try:
        wait_for_draft(target.address)
        lengths = burst(target.address)
        time.sleep(IDLE_S)
        lengths += burst(target.address)
        assert lengths == [48, 48, 48, 24, 24, 24] * 2
        assert scrape(f"http://127.0.0.1:{metrics_port}/metrics")["duo_draft:num_connections"] == 1
    finally:
        target.stop()
        draft.stop()
    assert "stopped reading" not in draft.log()
    assert draft.log().count("connected (") == 1, draft.log()  # one handshake: the target never reconnected
    assert " lost (" not in target.log() and target.log().count("connected (model") == 1, target.log()
