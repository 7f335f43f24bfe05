"""`duo bench --live-agents`: the agents run for real against duo-target with its draft attached, and what came of it.

duo-draft (pinned to the draft cores) and duo-target (the target cores, the draft attached, default flags but for
--metrics) are started from this checkout, or with --live-server llama-server llama.cpp's own llama-server serving the
target alone on the target's cores (no draft), so that what the model cannot do is told from what duo gets wrong:
everything after the server is the same. Then each chosen agent, as it ships on npm with its default settings and
tools (allowed to edit files in its folder: Agent.edit_flags), runs TASK non-interactively in an empty folder, every
request through the logging proxy and nothing past 127.0.0.1 (runs.py). Nothing rewrites the requests: the kit
measures what a user gets (a test may pass a rewrite of its own, `rewrite_for`, where the tiny models cannot choose).
The runs take turns, so the /metrics deltas around each are its drafts. The records go to
scripts/bench-results/live-agents-<time>.json and the table to stdout."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from duo.bench.agents import AGENT_CONTEXT
from duo.bench.cluster import ROOT, Cluster, Code, duo_command, spawn, wait_ready
from duo.bench.live.clients import AGENTS, TASK, Agent
from duo.bench.live.outcome import Drafts, Record, record, table
from duo.bench.live.proxy import Rewrite
from duo.bench.live.runs import run_agent
from duo.bench.llama_server import FLASH_OFF, llama_server_binary, start_peer, wait_peer_ready
from duo.bench.machine import cpu_model, this_commit
from duo.bench.report import Variant
from duo.models import hub
from duo.net.listening import free_port

RESULTS = ROOT / "scripts" / "bench-results"
# One agent's run at most: the F16 1.5B target on one core reads Claude Code's 18.8k-token first prompt in ~17 minutes
# (19 tokens/s on an AMD EPYC), and every later turn adds its tool results.
LIVE_TIMEOUT = 3600
READY_TIMEOUT = 900  # for both processes to load their models and the draft to attach
VERIFIED, ACCEPTED = "duo:spec_decode_num_draft_tokens_total", "duo:spec_decode_num_accepted_tokens_total"
AGENT_NAMES = tuple(agent.name for agent in AGENTS)
# llama-server's slots: duo-target's default --parallel, so that a side request a client sends beside its main one
# (Claude Code's) is served at once on both servers, not queued behind a prompt read for minutes.
LLAMA_SERVER_SLOTS = 4


@dataclass(frozen=True)
class Served:
    """The server the agents run against: its HTTP URL, and what the report says of it."""

    server: str  # "duo" or "llama-server"
    url: str
    drafting: bool  # a draft attached, whose tokens the server's /metrics count (duo-target's)
    about: dict[str, Any] = field(default_factory=dict)  # llama-server's binary, version, mode, slots, context


@contextlib.contextmanager
def served(target: Path, draft: Path, cores: tuple[set[int], set[int]], logs: Path) -> Iterator[Served]:
    """duo-target, with duo-draft attached, both stopped on exit. `cores`: (target's, draft's)."""
    code, (target_cores, draft_cores) = Code.at(ROOT), cores
    draft_address, address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    http = f"127.0.0.1:{free_port()}"
    processes = [spawn(duo_command(code.draft_module, ["--model", str(draft), "--listen", draft_address], draft_cores),
                       draft_cores, logs / "duo-draft.log", code)]
    processes.append(spawn(duo_command(code.target_module, ["--model", str(target), "--listen", address, "--http", http,
                                                        "--peer", draft_address, "--metrics"], target_cores),
                           target_cores, logs / "duo-target.log", code))
    cluster = Cluster(Variant("duo"), address, processes, speculative=True)
    try:
        print(f"live agents: duo-draft and duo-target starting (logs in {logs})", file=sys.stderr)
        wait_ready(cluster, READY_TIMEOUT)
        yield Served("duo", f"http://{http}", drafting=True)
    finally:
        cluster.stop()


@contextlib.contextmanager
def served_by_llama_server(target: Path, draft: Path, cores: tuple[set[int], set[int]], logs: Path
                           ) -> Iterator[Served]:
    """llama.cpp's llama-server serving the target alone (`draft` unused) on the target's cores, stopped on exit.
    Flash attention off, as duo-target runs (FLASH_OFF: llama-server at its best on a CPU), and AGENT_CONTEXT per
    slot for the agents' prompts. Its chat template renders the tools and its parsers read the calls with no flag:
    --jinja is llama-server's default in the pinned llama.cpp (common.h: use_jinja = true). No --metrics: with no
    draft its speculation counters say nothing, and the records say "no draft"."""
    binary = llama_server_binary()
    server = start_peer(binary, Variant(FLASH_OFF), (target, draft), cores, free_port(), LLAMA_SERVER_SLOTS,
                        logs / "llama-server.log", AGENT_CONTEXT)
    try:
        print(f"live agents: llama-server starting (log in {logs})", file=sys.stderr)
        wait_peer_ready(server, READY_TIMEOUT)
        yield Served("llama-server", f"http://{server.address}", drafting=False,
                     about={"binary": str(binary), "version": llama_server_version(binary), "mode": FLASH_OFF,
                            "slots": LLAMA_SERVER_SLOTS, "context_per_slot": AGENT_CONTEXT})
    finally:
        server.stop()


SERVERS = {"duo": served, "llama-server": served_by_llama_server}  # --live-server's choices


def llama_server_version(binary: Path) -> str:
    """What `llama-server --version` says of its build ("version: 0.5.0-dev (build 1, commit 0c1e570)")."""
    said = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = (said.stderr + said.stdout).splitlines()
    return next((line.strip() for line in lines if line.startswith("version:")), "unknown")


def drafts_so_far(served: Served) -> Drafts | None:
    """The draft tokens duo-target has verified and accepted since it started, from its /metrics; None with no draft."""
    if not served.drafting:
        return None
    samples = {s.name: s.value for family in text_string_to_metric_families(httpx.get(f"{served.url}/metrics").text)
               for s in family.samples if not s.labels}
    return Drafts(samples.get(VERIFIED, 0.0), samples.get(ACCEPTED, 0.0))


def drafts_since(served: Served, before: Drafts | None) -> Drafts | None:
    after = drafts_so_far(served)
    return None if after is None or before is None else after - before


def run_live_agents(names: Sequence[str], target: Path, draft: Path, cores: tuple[set[int], set[int]],
                    timeout: float = LIVE_TIMEOUT, results: Path = RESULTS,
                    rewrite_for: Callable[[Agent], Rewrite] | None = None,
                    server: str = "duo", attempts: int = 1) -> tuple[Path, list[Record]]:
    """Run the agents `names` (in AGENTS' order) one after the other against `server` (SERVERS: the pair, or
    llama-server serving the target alone), each up to `attempts` times, until one attempt gets the task done; the
    JSON's path and records (one per attempt made)."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    agents = [agent for agent in AGENTS if agent.name in names]
    for agent in agents:
        agent.executable()  # installed (minutes, once) before the servers start
    folder = Path(tempfile.mkdtemp(prefix="duo-live-agents-"))
    started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"live-agents-{started}.json"
    records: list[Record] = []
    with SERVERS[server](target, draft, cores, folder) as serving:
        about = {"commit": this_commit(), "cpu": cpu_model(), "task": TASK, "target": str(target),
                 **server_fields(serving, draft, cores), "started": started, "timeout_s": timeout,
                 "attempts": attempts, "edit_flags": {agent.name: list(agent.edit_flags) for agent in agents}}

        def keep(entry: Record) -> None:
            """Add an attempt's record and write the report as it stands: a run stopped for time (hours, on one
            core) keeps the attempts it made."""
            records.append(entry)
            path.write_text(json.dumps({**about, "agents": records}, indent=1) + "\n")

        for agent in agents:
            attempt_task(agent, serving, folder, rewrite_for(agent) if rewrite_for else None, timeout, attempts,
                         keep)
    return path, records


def attempt_task(agent: Agent, serving: Served, folder: Path, rewrite: Rewrite | None, timeout: float,
                 attempts: int, keep: Callable[[Record], None]) -> None:
    """`agent`'s runs on TASK until one gets it done or `attempts` were made: the model samples (the agents send no
    temperature: the server's default, 0.8 on both), so a small model's choice of a tool call or made-up text differs
    from run to run, and a user would ask again. Each attempt begins with an empty home and working folder at the
    same path (the one before kept beside it, under its number): the agents write their folder into the prompt
    (Claude Code an eighth of the way in), so a new path each time would leave a retry only that much of its prompt
    in the server's cache, where a user asking again in the same folder finds all of it. Each attempt's record goes
    to `keep` as it ends."""
    for attempt in range(1, attempts + 1):
        place, kept = folder / agent.name / "run", folder / agent.name / str(attempt)
        print(f"live agents: {agent.name} on {TASK!r}, attempt {attempt} of {attempts} (logs and folders in "
              f"{folder})", file=sys.stderr)
        before = drafts_so_far(serving)
        run = run_agent(agent, serving.url, mkdir(place), rewrite, timeout, may_edit=True)
        place.rename(kept)
        entry = {**record(run, drafts_since(serving, before), kept / "work"), "attempt": attempt}
        keep(entry)
        print(run.report(), file=sys.stderr)
        if entry["task"]["done"]:
            break


def server_fields(serving: Served, draft: Path, cores: tuple[set[int], set[int]]) -> dict[str, Any]:
    """The report's account of the server: which ran, the draft and the cores it used (no draft for llama-server
    alone: null, not a draft that went unused), and llama-server's build."""
    fields = {"server": serving.server, "draft": str(draft) if serving.drafting else None,
              "cores": {"target": sorted(cores[0]), "draft": sorted(cores[1]) if serving.drafting else []}}
    return {**fields, "llama_server": serving.about} if serving.about else fields


def mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def positive(value: str) -> int:
    """An argparse type: a whole number of at least 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def add_live_agents_arguments(parser: argparse.ArgumentParser) -> None:
    """`duo bench`'s --live-agents, --live-server, --live-timeout and --live-attempts."""
    parser.add_argument("--live-agents", nargs="*", choices=AGENT_NAMES, default=None, metavar="AGENT",
                        help=f"instead of the bench: run the coding agents ({', '.join(AGENT_NAMES)}; none named: "
                             "all) as they ship, with their default settings and tools, on 'create hello.py that "
                             "prints hello' against duo-target (--target, --target-cores) with duo-draft attached "
                             "(--draft, --draft-cores); a table, and a JSON in scripts/bench-results")
    parser.add_argument("--live-server", choices=tuple(SERVERS), default="duo",
                        help="--live-agents: the server the agents run against: duo (duo-target with duo-draft "
                             "attached) or llama-server (llama.cpp's, serving --target alone on --target-cores, no "
                             "draft), to tell what the model cannot do from what duo gets wrong (default: %(default)s)")
    parser.add_argument("--live-timeout", type=float, default=LIVE_TIMEOUT, metavar="SECONDS",
                        help="--live-agents: the longest one agent's run may take (default: %(default)g)")
    parser.add_argument("--live-attempts", type=positive, default=1, metavar="N",
                        help="--live-agents: run each agent up to N times against the same server (the model samples: "
                             "each run's answer differs) until one gets the task done; every attempt is recorded "
                             "(default: %(default)s)")


def live_agents_command(args: argparse.Namespace) -> int:
    """`duo bench --live-agents [AGENT ...]`: 0 when every agent got the task done (in one of its attempts), 1
    otherwise."""
    if len(args.target) != 1:
        raise SystemExit("bench: --live-agents runs against one --target")
    target, draft = hub.resolve_model(args.target[0]), hub.resolve_model(args.draft)
    path, records = run_live_agents(args.live_agents or AGENT_NAMES, target, draft,
                                    (set(args.target_cores), set(args.draft_cores)), args.live_timeout, RESULTS,
                                    server=args.live_server, attempts=args.live_attempts)
    print(table(records))
    print(f"\nwritten to {path}")
    done = {entry["agent"] for entry in records if entry["task"]["done"]}
    return 0 if done == {entry["agent"] for entry in records} else 1
