"""`duo bench --live-agents`' kit on the tiny pair: it starts duo-draft and duo-target with the draft attached, runs
an agent from npm on the task in an empty folder through the logging proxy, and writes a JSON record of each run
(requests, statuses, tool calls, drafts, first token, wall time, task done or not and why) beside the table; and
the same run against llama.cpp's llama-server serving the target alone (--live-server llama-server).

The tiny random models cannot choose a tool: the test injects the e2e test's forcing (helpers/agents/forcing.py)
where the kit, run for real, forwards the agents' requests as sent. Codex alone: its prompt is the shortest."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from duo.bench.live.kit import run_live_agents
from duo.bench.live.outcome import table
from helpers.agents.forcing import FirstCallForcer

# The kit starts duo-draft and duo-target itself (not through helpers.processes): marked here as conftest would.
pytestmark = [pytest.mark.processes,
              pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not on PATH: the agents install from npm")]


@pytest.fixture(scope="module")
def kit(long_tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    target, draft = long_tiny_pair
    cores = sorted(os.sched_getaffinity(0))
    forcers: dict[str, FirstCallForcer] = {}

    def forcing(agent) -> FirstCallForcer:
        forcers[agent.name] = FirstCallForcer(agent)
        return forcers[agent.name]

    results = tmp_path_factory.mktemp("bench-results")
    path, records = run_live_agents(["codex"], target, draft, ({cores[-1]}, {cores[0]}), timeout=240,
                                    results=results, rewrite_for=forcing)
    print(table(records))  # shown with -s
    return path, records, forcers


def test_the_json_holds_one_record_per_agent_run(kit):
    path, records, _ = kit
    report = json.loads(path.read_text())
    assert path.name.startswith("live-agents-") and report["task"] == "create hello.py that prints hello"
    assert [entry["agent"] for entry in report["agents"]] == ["codex"]
    assert report["agents"] == records


def test_the_record_shows_every_request_answered_and_the_tool_called(kit):
    _, [codex], forcers = kit
    assert codex["model_calls"] >= 2, codex  # the call, then its result sent back
    assert all(200 <= request["status"] < 300 for request in codex["requests"]), codex
    assert forcers["codex"].forced in codex["tool_calls"], codex


def test_the_record_times_the_first_token_within_the_run(kit):
    _, [codex], _ = kit
    assert 0 < codex["first_token_s"] <= codex["wall_s"], codex


def test_the_drafts_are_the_targets_over_the_run(kit):
    _, [codex], _ = kit
    assert codex["drafts"]["verified"] >= codex["drafts"]["accepted"] > 0, codex


def test_the_task_is_judged_from_the_folder_the_agent_worked_in(kit):
    _, [codex], _ = kit
    # The forced run ends with the one-word answer: no hello.py, and the record says so.
    assert codex["task"] == {"done": False, "why": "no hello.py in the folder"}, codex
    assert Path(codex["folder"]).is_dir() and Path(codex["folder"]).name == "work"


@pytest.fixture(scope="module")
def kit_on_llama_server(long_tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    """The same run, the same way, against llama.cpp's llama-server serving the target alone (--live-server
    llama-server). llama-server reads a named tool_choice as "auto" (the pinned llama.cpp's json_value falls back to
    the default on an object), so the forced call is not made there: the run shows the path, not a tool call."""
    target, draft = long_tiny_pair
    cores = sorted(os.sched_getaffinity(0))
    results = tmp_path_factory.mktemp("bench-results-llama-server")
    path, records = run_live_agents(["codex"], target, draft, ({cores[-1]}, {cores[0]}), timeout=240,
                                    results=results, rewrite_for=FirstCallForcer, server="llama-server")
    print(table(records))  # shown with -s
    return json.loads(path.read_text()), records


@pytest.mark.timeout(1800)  # a clean machine builds llama-server first (6-8 minutes on 2 idle cores)
def test_against_llama_server_the_report_names_it_and_its_build_and_no_draft(kit_on_llama_server):
    report, [codex] = kit_on_llama_server
    assert report["server"] == "llama-server" and report["draft"] is None
    assert report["llama_server"]["mode"] == "llama-server-fa-off"
    assert report["llama_server"]["version"].startswith("version:")
    assert codex["drafts"] is None and "no draft" in table([codex])


@pytest.mark.timeout(1800)
def test_against_llama_server_the_agents_requests_are_answered_and_judged_alike(kit_on_llama_server):
    _, [codex] = kit_on_llama_server
    assert codex["model_calls"] >= 1 and all(200 <= request["status"] < 300 for request in codex["requests"]), codex
    assert 0 < codex["first_token_s"] <= codex["wall_s"], codex
    assert codex["task"] == {"done": False, "why": "no hello.py in the folder"}, codex
