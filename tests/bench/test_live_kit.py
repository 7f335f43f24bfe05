"""`duo bench --live-agents --live-server`: the agents run against duo (duo-target with duo-draft attached) or against
llama.cpp's llama-server serving the target alone, the same way, and the report says which ran and that llama-server
had no draft. The servers and the agents are stand-ins here; tests/e2e/test_live_agents.py runs them for real."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from duo.bench.agents import AGENT_CONTEXT
from duo.bench.live import kit
from duo.bench.live.clients import Agent
from duo.bench.live.runs import AgentRun
from duo.bench.machine import cpu_model, this_commit
from duo.cli.main import build_parser, main

VERSION = "version: 9.9.9 (build 7, commit abc1234)"


@pytest.fixture(autouse=True)
def folders_in_tmp_path(monkeypatch, tmp_path):
    """The kit's folder for logs and runs (tempfile.mkdtemp) in the test's own, not left in /tmp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def parsed(*flags: str):
    return build_parser().parse_args(["bench", "--live-agents", "codex", *flags])


def test_the_agents_run_against_duo_unless_llama_server_is_asked_for():
    assert parsed().live_server == "duo" and kit.SERVERS["duo"] is kit.served
    assert parsed("--live-server", "llama-server").live_server == "llama-server"
    assert kit.SERVERS["llama-server"] is kit.served_by_llama_server
    with pytest.raises(SystemExit):
        parsed("--live-server", "vllm")


class StandInPeer:
    """What start_peer returns, listening nowhere."""

    address = "127.0.0.1:9"
    stopped = False

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def llama_server_run(monkeypatch, tmp_path, capsys) -> SimpleNamespace:
    """`duo bench --live-agents codex --live-server llama-server` with stand-ins for llama-server's process and for
    Codex, whose run leaves its folder empty: its exit status, what start_peer was asked, the JSON report and the
    table printed."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\necho '{VERSION}' >&2\necho 'built with cc' >&2\n")  # as the real one prints
    binary.chmod(0o755)
    peer, started = StandInPeer(), {}

    def start_peer(binary, variant, models, cores, port, parallel, log, context):
        started.update(mode=variant.mode, models=models, cores=cores, parallel=parallel, context=context)
        return peer

    def run_agent(agent, upstream, tmp, rewrite, timeout, may_edit):
        started["upstream"] = upstream
        return AgentRun(agent, 0, "Hello!\n", [], [], 1.5)

    monkeypatch.setattr(kit, "llama_server_binary", lambda: binary)
    monkeypatch.setattr(kit, "start_peer", start_peer)
    monkeypatch.setattr(kit, "wait_peer_ready", lambda server, timeout: None)
    monkeypatch.setitem(kit.SERVERS, "duo", lambda *args: pytest.fail("duo started"))
    monkeypatch.setattr(kit, "run_agent", run_agent)
    monkeypatch.setattr(kit, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(kit.hub, "resolve_model", lambda name: Path(f"/m/{name}.gguf"))
    monkeypatch.setattr(Agent, "executable", lambda self: Path(f"/bin/{self.binary}"))
    status = main(["bench", "--live-agents", "codex", "--live-server", "llama-server", "--target", "t", "--draft", "d",
                   "--target-cores", "1", "--draft-cores", "0"])
    [path] = (tmp_path / "results").glob("live-agents-*.json")
    return SimpleNamespace(status=status, started=started, peer=peer, report=json.loads(path.read_text()),
                           binary=binary, table=capsys.readouterr().out)


def test_llama_server_serves_the_target_alone_on_its_cores_with_the_agents_context(llama_server_run):
    started = llama_server_run.started
    assert started["mode"] == "llama-server-fa-off"  # alone, flash attention off as duo-target runs
    assert started["models"][0] == Path("/m/t.gguf") and started["cores"] == ({1}, {0})
    assert started["context"] == AGENT_CONTEXT and started["parallel"] == kit.LLAMA_SERVER_SLOTS
    assert started["upstream"] == "http://127.0.0.1:9" and llama_server_run.peer.stopped


def test_the_report_names_llama_server_and_its_build_and_says_no_draft_ran(llama_server_run):
    report = llama_server_run.report
    assert llama_server_run.status == 1  # the task is not done: the stand-in agent wrote nothing
    assert report["server"] == "llama-server" and report["draft"] is None
    assert report["commit"].startswith(this_commit().removesuffix("+dirty")) and report["cpu"] == cpu_model()
    assert report["cores"] == {"target": [1], "draft": []}
    assert report["llama_server"] == {"binary": str(llama_server_run.binary), "version": VERSION, "mode": "llama-server-fa-off",
                                      "slots": kit.LLAMA_SERVER_SLOTS, "context_per_slot": AGENT_CONTEXT}
    [codex] = report["agents"]
    assert codex["drafts"] is None and codex["task"] == {"done": False, "why": "no hello.py in the folder"}


def test_the_table_says_no_draft_where_llama_server_ran_alone(llama_server_run):
    header, row = llama_server_run.table.splitlines()[:2]
    assert "drafts acc/ver" in header
    assert row.split()[0] == "codex" and "no draft" in row and "0/0" not in row


@pytest.fixture
def attempts_run(monkeypatch, tmp_path, capsys):
    """`duo bench --live-agents codex --live-attempts N` against a stand-in duo whose stand-in Codex writes a working
    hello.py on its `succeeds_at`-th run (0: never): run(N, succeeds_at) gives the exit status, the report, the folders
    the runs were given and the table."""

    @contextlib.contextmanager
    def duo(target, draft, cores, logs):
        yield kit.Served("duo", "http://127.0.0.1:9", drafting=False)

    def run(attempts: int, succeeds_at: int) -> SimpleNamespace:
        places: list[Path] = []
        began_empty: list[bool] = []
        on_disk: list[int] = []  # the attempts the report on disk held as each attempt began
        results = tmp_path / f"results-{attempts}-{succeeds_at}"

        def run_agent(agent, upstream, tmp, rewrite, timeout, may_edit):
            places.append(tmp)
            began_empty.append(not any(tmp.iterdir()))
            written = list(results.glob("live-agents-*.json"))
            on_disk.append(len(json.loads(written[0].read_text())["agents"]) if written else 0)
            (tmp / "work").mkdir()
            if len(places) == succeeds_at:
                (tmp / "work" / "hello.py").write_text("print('hello')\n")
            return AgentRun(agent, 0, "Done.\n", [], [], 1.0)

        monkeypatch.setitem(kit.SERVERS, "duo", duo)
        monkeypatch.setattr(kit, "run_agent", run_agent)
        monkeypatch.setattr(kit, "RESULTS", results)
        monkeypatch.setattr(kit.hub, "resolve_model", lambda name: Path(f"/m/{name}.gguf"))
        monkeypatch.setattr(Agent, "executable", lambda self: Path(f"/bin/{self.binary}"))
        status = main(["bench", "--live-agents", "codex", "--live-attempts", str(attempts), "--target", "t",
                       "--draft", "d", "--target-cores", "1", "--draft-cores", "0"])
        [path] = results.glob("live-agents-*.json")
        return SimpleNamespace(status=status, report=json.loads(path.read_text()), places=places,
                               began_empty=began_empty, on_disk=on_disk, table=capsys.readouterr().out)

    return run


def test_an_agent_runs_again_until_an_attempt_gets_the_task_done_each_in_an_empty_folder_at_the_same_path(attempts_run):
    ran = attempts_run(attempts=4, succeeds_at=2)
    assert ran.status == 0 and ran.report["attempts"] == 4
    assert [(entry["attempt"], entry["task"]["done"]) for entry in ran.report["agents"]] == [(1, False), (2, True)]
    # The same path each time (the agents write it into their prompts: a retry finds them cached), empty at the start.
    assert [place.name for place in ran.places] == ["run", "run"] and ran.places[0] == ran.places[1]
    assert ran.began_empty == [True, True]
    # Each attempt's folder is kept under its number, and its record names where.
    kept = [ran.places[0].parent / str(attempt) / "work" for attempt in (1, 2)]
    assert [entry["folder"] for entry in ran.report["agents"]] == [str(path) for path in kept]
    assert not (kept[0] / "hello.py").exists() and (kept[1] / "hello.py").exists()
    rows = [line for line in ran.table.splitlines() if line.startswith("codex")]
    assert [row.split()[1] for row in rows] == ["1", "2"]  # the try column
    assert rows[0].endswith("NOT done") and rows[1].endswith(" done") and not rows[1].endswith("NOT done")


def test_every_attempt_is_recorded_and_the_bench_fails_when_none_got_it_done(attempts_run):
    ran = attempts_run(attempts=3, succeeds_at=0)
    assert ran.status == 1
    assert [entry["attempt"] for entry in ran.report["agents"]] == [1, 2, 3]
    assert ran.on_disk == [0, 1, 2]  # the report is written as each attempt ends: a run stopped for time keeps them
    assert all(entry["task"] == {"done": False, "why": "no hello.py in the folder"} for entry in ran.report["agents"])


def test_attempts_are_whole_numbers_of_at_least_one():
    assert parsed().live_attempts == 1 and parsed("--live-attempts", "3").live_attempts == 3
    for wrong in ("0", "-2", "two"):
        with pytest.raises(SystemExit):
            parsed("--live-attempts", wrong)
