"""Codex CLI, Claude Code, Qwen Code and opencode as they ship on npm (pinned versions, default tool sets), each run
non-interactively on a small task in an empty folder against duo-target with a draft attached, through a logging
proxy that records every exchange: every request is answered 2xx, every stream is well formed and the client takes
it, the tool call the proxy forced goes out and its result comes back, drafts are accepted, and nothing leaves
127.0.0.1.

The tiny random models can neither choose a tool nor end an answer: the proxy forces each run's first call to a
harmless tool of the client's own and holds the other answers to one word (helpers/agents/forcing.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from duo.bench.live.clients import AGENTS, Agent
from duo.bench.live.runs import AgentRun, run_agent
from duo.bench.live.streams import called, malformations, returned_results
from helpers.agents.forcing import ANSWER, FirstCallForcer
from helpers.http import scrape
from helpers.processes import Process, start, wait_for_draft

pytestmark = pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not on PATH: the agents install from npm")

# The agents' first prompts are 9k (Codex) to 19k (Claude Code) tokens: the long tiny pair has room for them.
CONTEXT = 32768
ACCEPTED = ("duo:spec_decode_num_accepted_tokens_total", ())
# What the clients print when a stream or an answer did not parse, or a request failed (opencode's: "JSON parsing
# failed: Text: ...", from its AI SDK, for a chunk that does not parse).
CLIENT_ERRORS = re.compile(r"\bERROR\b|API Error|stream (error|disconnected)|[Ff]ailed to parse|InvalidStreamError|"
                           r"Model stream ended|Unexpected (token|end of JSON)|JSON pars(ing failed|e error)")


@pytest.fixture(scope="module")
def agents_target(long_tiny_pair: tuple[Path, Path], process_logs: Path):
    """duo-target beside its draft. The draft length is fixed and lookup off, so that the draft takes part in every
    answer whatever the adaptive policy would make of a tiny draft, and every accepted token is the draft's."""
    target, draft = long_tiny_pair
    drafting = start("duo.cli.draft", ["--model", str(draft), "--ctx-size", str(CONTEXT)], process_logs)
    process = start("duo.cli.target", ["--model", str(target), "--ctx-size", str(CONTEXT), "--peer", drafting.address,
                                       "--draft-max", "4", "--no-lookup"], process_logs, http=True)
    wait_for_draft(process.address)
    yield process
    process.stop()
    drafting.stop()


@pytest.fixture(scope="module", params=AGENTS, ids=lambda agent: agent.name)
def run(request: pytest.FixtureRequest, agents_target: Process,
        tmp_path_factory: pytest.TempPathFactory) -> tuple[AgentRun, float, FirstCallForcer]:
    """The agent's run, the draft tokens the target accepted during it (the runs take turns), and the forcing."""
    agent: Agent = request.param
    agent.executable()  # installed (minutes, once) before the run's clock starts
    before = scrape(agents_target).get(ACCEPTED, 0.0)
    forcer = FirstCallForcer(agent)
    done = run_agent(agent, agents_target.http_url, tmp_path_factory.mktemp(agent.name), forcer)
    accepted = scrape(agents_target).get(ACCEPTED, 0.0) - before
    print(f"{done.report()}\n  draft tokens accepted: {accepted:g}")  # shown with -s: the run as it went
    return done, accepted, forcer


def test_every_request_the_agent_sends_is_answered_2xx(run):
    done, _, _ = run
    assert done.model_calls(), done.report()
    assert all(200 <= e.status < 300 for e in done.exchanges), done.report()


def test_every_stream_is_well_formed_and_the_agent_takes_it(run):
    done, _, _ = run
    streams = [e for e in done.model_calls() if e.is_stream()]
    assert streams, done.report()
    for exchange in streams:
        assert malformations(exchange.path, exchange.answer) == [], f"{exchange.summary()}\n{done.report()}"
    assert done.returncode == 0, done.report()
    assert not CLIENT_ERRORS.search(done.output), done.report()
    # The last answer, as the client printed it: the client read that stream to its end.
    assert json.dumps(ANSWER["enum"][0]) in done.output, done.report()


def test_the_forced_tool_call_goes_out_and_its_result_comes_back(run):
    done, _, forcer = run
    assert forcer.forced is not None, f"no call offered any of {done.agent.harmless_tools}\n{done.report()}"
    forced = done.exchanges[forcer.forced_index]
    calls = called(forced.path, forced.answer)
    # One call or more (the clients allow parallel calls), each to the forced tool, each answered in a later request.
    assert calls and {name for _, name in calls} == {forcer.forced}, done.report()
    later = [e for e in done.exchanges[forcer.forced_index + 1:] if e.path == done.agent.model_path]
    returned = {call for e in later for call in returned_results(e.path, e.sent_json() or {})}
    assert {call for call, _ in calls} <= returned, done.report()


def test_drafts_are_accepted_while_the_agent_works(run):
    done, accepted, _ = run
    assert accepted > 0, done.report()


def test_nothing_the_agent_sends_leaves_localhost(run):
    done, _, _ = run
    assert done.attempts == [], done.report()
