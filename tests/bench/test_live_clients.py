"""How `duo bench --live-agents` runs each agent: its default command with the one permission TASK needs, to edit
files in its folder, and nothing else changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from duo.bench.live.clients import AGENTS, SLOW_TARGET_MS, TASK, Agent

EDIT_FLAGS = {"codex": ["--sandbox", "workspace-write"], "claude-code": ["--permission-mode", "acceptEdits"],
              "qwen-code": ["--approval-mode", "auto-edit"], "opencode": []}  # opencode's build agent may edit


@pytest.fixture(autouse=True)
def no_install(monkeypatch):
    monkeypatch.setattr(Agent, "executable", lambda self: f"/bin/{self.binary}")


@pytest.mark.parametrize("agent", AGENTS, ids=lambda agent: agent.name)
def test_an_agent_allowed_to_edit_gets_its_edit_flags_before_the_task(agent, tmp_path):
    plain, variables = agent.command(tmp_path, "http://127.0.0.1:1")
    editing, same_variables = agent.command(tmp_path, "http://127.0.0.1:1", may_edit=True)
    assert editing == plain[:-1] + EDIT_FLAGS[agent.name] + [TASK]
    assert same_variables == variables


@pytest.mark.parametrize("agent", AGENTS, ids=lambda agent: agent.name)
def test_an_agent_not_allowed_to_edit_runs_its_default_command(agent, tmp_path):
    argv, _ = agent.command(tmp_path, "http://127.0.0.1:1")
    assert argv[-1] == TASK and not set(EDIT_FLAGS[agent.name]) & set(argv)


def test_claude_code_waits_half_an_hour_for_a_request_and_between_its_events():
    """Its stream watchdog (reset by every event but ping) and its per-request limit (API_TIMEOUT_MS, 10 minutes by
    default) both cut a prompt read on a CPU core: a sub-agent's first 11k-token request was cut at 600 s."""
    claude_code = next(agent for agent in AGENTS if agent.name == "claude-code")
    _, variables = claude_code.command(Path("/nonexistent"), "http://127.0.0.1:1")
    assert variables["CLAUDE_STREAM_IDLE_TIMEOUT_MS"] == variables["API_TIMEOUT_MS"] == str(SLOW_TARGET_MS)
    assert SLOW_TARGET_MS >= 30 * 60 * 1000
