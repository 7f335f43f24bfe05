"""`duo bench --live-agents --live-server`: the agents run against duo (duo-target with duo-draft attached) or against
llama.cpp's llama-server serving the target alone, the same way, and the report says which ran and that llama-server
had no draft. The servers and the agents are stand-ins here; tests/e2e/test_live_agents.py runs them for real."""

from __future__ import annotations

import json
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
