"""How the live kit points opencode at duo: its global config names an OpenAI-compatible provider at the proxy, and
every kind of vendor traffic it does by default is off (the update check, sharing, the models.dev catalog, the
language servers' downloads, and the npm install of @opencode-ai/plugin it runs in its config folder at each start)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from duo.bench.agents import AGENT_CONTEXT
from duo.bench.live.clients import AGENTS, TASK, Agent

PROXY = "http://127.0.0.1:1"


@pytest.fixture
def opencode(monkeypatch) -> Agent:
    monkeypatch.setattr(Agent, "executable", lambda self: Path(f"/bin/{self.binary}"))
    return next(agent for agent in AGENTS if agent.name == "opencode")


def config_folder(home: Path) -> Path:
    return home / ".config" / "opencode"  # $XDG_CONFIG_HOME/opencode, XDG_CONFIG_HOME being home/.config (runs.py)


def test_opencode_runs_the_task_non_interactively_at_its_pinned_version(opencode, tmp_path):
    argv, _ = opencode.command(tmp_path, PROXY)
    assert (opencode.package, opencode.version) == ("opencode-ai", "1.18.33")
    assert argv == ["/bin/opencode", "run", TASK]


def test_opencode_speaks_chat_completions_to_the_proxy_as_an_openai_compatible_provider(opencode, tmp_path):
    opencode.command(tmp_path, PROXY)
    config = json.loads((config_folder(tmp_path) / "opencode.json").read_text())
    provider, model = config["model"].split("/")
    assert config["provider"][provider]["npm"] == "@ai-sdk/openai-compatible"
    assert config["provider"][provider]["options"]["baseURL"] == f"{PROXY}/v1"
    assert model in config["provider"][provider]["models"]
    assert opencode.model_path == "/v1/chat/completions"


def test_opencode_waits_half_an_hour_for_a_slow_targets_headers_and_chunks(opencode, tmp_path):
    """Its provider's 5-minute defaults abandoned the F16 target's read of its 7.2k-token prompt on one core."""
    opencode.command(tmp_path, PROXY)
    config = json.loads((config_folder(tmp_path) / "opencode.json").read_text())
    options = config["provider"]["duo"]["options"]
    assert [options[key] for key in ("timeout", "headerTimeout", "chunkTimeout")] == [1_800_000] * 3


def test_opencode_checks_for_no_update_and_shares_nothing(opencode, tmp_path):
    opencode.command(tmp_path, PROXY)
    config = json.loads((config_folder(tmp_path) / "opencode.json").read_text())
    assert config["autoupdate"] is False and config["share"] == "disabled"


def test_opencode_reads_its_bundled_catalog_and_downloads_no_language_server(opencode, tmp_path):
    _, variables = opencode.command(tmp_path, PROXY)
    assert variables["OPENCODE_DISABLE_MODELS_FETCH"] == "1" and variables["OPENCODE_DISABLE_LSP_DOWNLOAD"] == "1"


def test_opencodes_config_folder_needs_no_npm_install(opencode, tmp_path):
    """opencode installs into a config folder unless it has a node_modules and every package its package.json names
    is in its package-lock.json's root entry, @opencode-ai/plugin among them."""
    opencode.command(tmp_path, PROXY)
    folder = config_folder(tmp_path)
    wanted = json.loads((folder / "package.json").read_text())["dependencies"]
    locked = json.loads((folder / "package-lock.json").read_text())["packages"][""]["dependencies"]
    assert (folder / "node_modules").is_dir()
    assert "@opencode-ai/plugin" in wanted and set(wanted) <= set(locked)



def test_opencode_knows_the_context_it_is_served_so_that_it_compacts_in_time(opencode, tmp_path):
    """A model opencode does not know has a context of 0, which it takes for no limit: it never compacts."""
    opencode.command(tmp_path, PROXY)
    config = json.loads((config_folder(tmp_path) / "opencode.json").read_text())
    provider, model = config["model"].split("/")
    limit = config["provider"][provider]["models"][model]["limit"]
    assert limit["context"] == AGENT_CONTEXT and 0 < limit["output"] < limit["context"]
