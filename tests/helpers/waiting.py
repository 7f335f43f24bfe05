"""Waiting in tests for a condition to hold, with a bound, failing with what was awaited and the logs of the processes
that should have made it hold (and at once where one of them exited)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from helpers.processes import Process


def until(condition: Callable[[], bool], *processes: Process, what: str = "", timeout: float = 60.0) -> None:
    """Poll `condition` until it holds; AssertionError after `timeout` s or as soon as one of `processes` exits."""
    deadline = time.monotonic() + timeout
    while not condition():
        _check(processes, what, deadline)
        time.sleep(0.02)


async def until_async(condition: Callable[[], bool], *processes: Process, what: str = "",
                      timeout: float = 30.0) -> None:
    """until's twin for a test's event loop: the loop runs meanwhile."""
    deadline = time.monotonic() + timeout
    while not condition():
        _check(processes, what, deadline)
        await asyncio.sleep(0.02)


def _check(processes: tuple[Process, ...], what: str, deadline: float) -> None:
    for process in processes:
        assert process.popen.poll() is None, f"a process exited while waiting for {what or 'a condition'}:\n{process.log()}"
    assert time.monotonic() < deadline, (f"timed out waiting for {what or 'a condition'}"
                                         + "".join(f"\n{process.log()}" for process in processes))
