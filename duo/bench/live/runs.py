"""One agent's run on TASK in an empty folder against duo-target, through the logging proxy (and the trap)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from duo.bench.live.clients import Agent
from duo.bench.live.proxy import Exchange, LoggingProxy, Rewrite
from duo.bench.live.trap import ProxyTrap

TIMEOUT = 240  # seconds for one run: the tiny models read a 19k-token prompt in a minute on a loaded core
NODE_GUARD = Path(__file__).with_name("node_guard.cjs")


@dataclass
class AgentRun:
    agent: Agent
    returncode: int
    output: str  # stdout and stderr together
    exchanges: list[Exchange]
    attempts: list[str]  # connections refused (by the trap or the Node guard): anything headed beyond 127.0.0.1
    seconds: float

    def model_calls(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.path == self.agent.model_path]

    def report(self) -> str:
        lines = [f"{self.agent.name} {self.agent.version}: exit {self.returncode} after {self.seconds:.1f}s"]
        lines += [f"  {e.summary()} {e.answer[:300]!r}" if e.status >= 300 else f"  {e.summary()}"
                  for e in self.exchanges]
        lines += [f"  refused: {a}" for a in self.attempts]
        return "\n".join(lines + ["--- output (tail) ---", self.output[-3000:]])


def run_agent(agent: Agent, upstream: str, tmp: Path, rewrite: Rewrite | None = None,
              timeout: float = TIMEOUT, may_edit: bool = False) -> AgentRun:
    """Run `agent` on TASK with HOME and the working folder (tmp/work) in `tmp`, its model calls through a logging
    proxy that applies `rewrite` (none: the agent's requests go to duo-target as sent), for `timeout` seconds at most;
    with `may_edit`, allowed to edit files in its folder (Agent.edit_flags)."""
    home, work = tmp / "home", tmp / "work"
    home.mkdir()
    work.mkdir()
    with LoggingProxy(upstream, rewrite) as proxy, ProxyTrap() as trap:
        argv, variables = agent.command(home, proxy.url, may_edit)
        guard_log = tmp / "node-guard.log"
        guard_log.touch()
        env = {**isolated_environment(home), **variables, **guarded(agent, trap, guard_log)}
        started = time.monotonic()
        returncode, output = run_bounded(argv, work, env, timeout)
        seconds = time.monotonic() - started
        wait_for_answers(proxy)
    attempts = trap.attempts + guard_log.read_text().splitlines()
    return AgentRun(agent, returncode, output, list(proxy.exchanges), attempts, seconds)


def guarded(agent: Agent, trap: ProxyTrap, guard_log: Path) -> dict[str, str]:
    """The environment variables that catch `agent`'s connections beyond 127.0.0.1."""
    if agent.guard == "node":
        return {"NODE_OPTIONS": f"--require {NODE_GUARD}", "DUO_NODE_GUARD_LOG": str(guard_log)}
    return {"HTTPS_PROXY": trap.url, "HTTP_PROXY": trap.url, "ALL_PROXY": trap.url, "NO_PROXY": "127.0.0.1,localhost"}


def run_bounded(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = TIMEOUT) -> tuple[int, str]:
    """Exit status (-1 when killed after `timeout`) and output of `argv`. It runs in a process group of its own, killed
    whole at the timeout: Qwen Code relaunches itself in a child (relaunchAppInChildProcess, for a larger heap), which
    would otherwise outlive it, holding the pipe open."""
    with subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True) as child:
        try:
            output, _ = child.communicate(timeout=timeout)
            return child.returncode, output.decode(errors="replace")
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            output, _ = child.communicate()
            return -1, output.decode(errors="replace") + f"\n(killed after {timeout:g}s)"


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
