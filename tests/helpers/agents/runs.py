"""One agent's run on TASK in an empty folder against duo-target, through the logging proxy (and the trap)."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from helpers.agents.clients import Agent
from helpers.agents.forcing import FirstCallForcer
from helpers.agents.proxy import Exchange, LoggingProxy
from helpers.agents.trap import ProxyTrap

TIMEOUT = 120  # seconds for one run; the tiny models answer each call in seconds


@dataclass
class AgentRun:
    agent: Agent
    returncode: int
    output: str  # stdout and stderr together
    exchanges: list[Exchange]
    forced: FirstCallForcer
    attempts: list[str]  # connections the trap refused: anything headed beyond 127.0.0.1
    seconds: float

    def model_calls(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.path == self.agent.model_path]

    def report(self) -> str:
        lines = [f"{self.agent.name} {self.agent.version}: exit {self.returncode} after {self.seconds:.1f}s,"
                 f" forced {self.forced.forced!r}"]
        lines += [f"  {e.summary()} {e.answer[:300]!r}" if e.status >= 300 else f"  {e.summary()}"
                  for e in self.exchanges]
        lines += [f"  trapped: {a}" for a in self.attempts]
        return "\n".join(lines + ["--- output (tail) ---", self.output[-3000:]])


def run_agent(agent: Agent, upstream: str, tmp: Path) -> AgentRun:
    """Run `agent` on TASK with HOME and the working folder in `tmp`, its model calls through a logging proxy."""
    home, work = tmp / "home", tmp / "work"
    home.mkdir()
    work.mkdir()
    forcer = FirstCallForcer(agent)
    with LoggingProxy(upstream, forcer) as proxy, ProxyTrap() as trap:
        argv, variables = agent.command(home, proxy.url)
        env = {**isolated_environment(home), **variables}
        if agent.honours_no_proxy:
            env |= {"HTTPS_PROXY": trap.url, "HTTP_PROXY": trap.url, "ALL_PROXY": trap.url,
                    "NO_PROXY": "127.0.0.1,localhost"}
        started = time.monotonic()
        try:
            done = subprocess.run(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, timeout=TIMEOUT)
            returncode, output = done.returncode, done.stdout.decode(errors="replace")
        except subprocess.TimeoutExpired as expired:
            returncode, output = -1, (expired.stdout or b"").decode(errors="replace") + f"\n(killed after {TIMEOUT}s)"
        seconds = time.monotonic() - started
        wait_for_answers(proxy)
    return AgentRun(agent, returncode, output, list(proxy.exchanges), forcer, list(trap.attempts), seconds)


def isolated_environment(home: Path) -> dict[str, str]:
    """PATH and the locale from this process; HOME and the XDG folders in `home`, so no user's config is read."""
    keep = {name: os.environ[name] for name in ("PATH", "LANG", "LC_ALL", "TERM") if name in os.environ}
    return {**keep, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_CACHE_HOME": str(home / ".cache"), "XDG_DATA_HOME": str(home / ".local" / "share"),
            "XDG_STATE_HOME": str(home / ".local" / "state")}


def wait_for_answers(proxy: LoggingProxy, timeout: float = 10) -> None:
    """Until every answer the proxy relayed has ended (a client that exits may leave one being read)."""
    deadline = time.monotonic() + timeout
    while any(not e.done and e.status for e in proxy.exchanges) and time.monotonic() < deadline:
        time.sleep(0.05)
