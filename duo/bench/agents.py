"""`duo bench --prompts agent`: the coding agents' first requests, rendered as the target reads them, sent alike to duo
and to llama-server.

The bodies are the first request each agent sent with its default settings (duo/bench/agent_prompts/NAME.json: Codex
CLI's Responses body, Claude Code's Messages body, Qwen Code's and opencode's chat bodies; opencode's first with its
tools, after its title request). Beside each, NAME.chat.json holds the chat duo's API makes of it (the messages and
tools its chat template is given), written by scripts/agent_chats.py through the API's own translation (the bench
sits beside duo.api and does not import it; tests/bench/test_agent_chats.py keeps the two equal). Each chat is
rendered once by the target's own chat template, so that duo (a raw gRPC prompt) and llama-server (a raw /completion
prompt) read the very same tokens, the ones duo-target reads when the agent sends its body: the agents' long prompts
(6-18k tokens) make time to first token and the decode rate at long context the numbers that matter, reported per
agent with the context length (agent_table). One request at a time, no prompt cache, greedy or sampled as
--temperatures says; every answer is cut at --max-tokens.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import grpc

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.bench.cluster import Cluster
from duo.bench.llama_server import PeerAnswer, PeerServer, answer_tokens, run_from_answer
from duo.bench.report import Run, run_from_stats

AGENT_PROMPTS = Path(__file__).resolve().parent / "agent_prompts"
AGENTS = ("codex", "claude_code", "qwen_code", "opencode")  # in table order
# The context both servers get for the agents' prompts (Claude Code's is 18k tokens): Qwen2.5-Coder's whole
# training context, what llama-server and duo-target serve by default.
AGENT_CONTEXT = 32768
Body = dict[str, Any]


@dataclass(frozen=True)
class AgentPrompt:
    """An agent's first request as a chat: the messages, function tools and variables duo's template is given, and its
    text once rendered."""

    agent: str
    messages: list[Body]
    tools: list[Body]
    variables: Body = field(default_factory=dict)  # the template's, as the body sets them ({"enable_thinking": true})
    text: str = ""  # rendered by the target's chat template (render)


def read_agent_prompts(folder: Path = AGENT_PROMPTS, agents: Iterable[str] = AGENTS) -> list[AgentPrompt]:
    """The chats of `agents` (duo bench --agents), in table order; SystemExit where one is missing."""
    prompts = []
    for agent in (agent for agent in AGENTS if agent in agents):
        path = folder / f"{agent}.chat.json"
        if not path.is_file():
            raise SystemExit(f"bench: no agent chat at {path} (--prompts agent needs all of {', '.join(AGENTS)}; "
                             "scripts/agent_chats.py writes them from the captured bodies)")
        chat = json.loads(path.read_text())
        prompts.append(AgentPrompt(agent, chat["messages"], chat["tools"], chat["variables"]))
    return prompts


def render(prompts: list[AgentPrompt], chat_prompt: Callable[[list[Body], list[Body], Body | None], str]
           ) -> list[AgentPrompt]:
    """Each prompt with its text as `chat_prompt(messages, tools, variables)` renders it (the target's template)."""
    return [replace(prompt, text=chat_prompt(prompt.messages, prompt.tools, prompt.variables or None))
            for prompt in prompts]


def render_with_model(prompts: list[AgentPrompt], target: Path) -> list[AgentPrompt]:
    """The prompts rendered by the target GGUF's chat template (its weights mapped, never run)."""
    from duo.llama.model import Model

    model = Model(target, threads=1)
    try:
        return render(prompts, model.chat_prompt)
    finally:
        model.close()


def duo_request(text: str, temperature: float, max_tokens: int) -> pb.GenerateRequest:
    """duo's request for a rendered prompt: raw text (its special tokens read as such), no prompt cache."""
    return pb.GenerateRequest(prompt=text, max_tokens=max_tokens, sampling=pb.SamplingParams(temperature=temperature),
                              cache_prompt=False)


def peer_request(text: str, temperature: float, max_tokens: int) -> Body:
    """llama-server's /completion request for the same text, sampled as duo samples (no truncation)."""
    return {"prompt": text, "n_predict": max_tokens, "temperature": temperature, "top_k": 0, "top_p": 1.0,
            "min_p": 0.0, "cache_prompt": False, "stream": True}


def ask_duo(cluster: Cluster, prompt: AgentPrompt, temperature: float, rep: int, max_tokens: int) -> Run:
    started = time.perf_counter()
    first, last = None, pb.GenerateResponse()
    with grpc.insecure_channel(cluster.address) as channel:
        for last in pb_grpc.TargetStub(channel).Generate(duo_request(prompt.text, temperature, max_tokens),
                                                         wait_for_ready=True, timeout=3600):
            if first is None and last.token_ids:
                first = time.perf_counter() - started
    seconds = time.perf_counter() - started
    run = run_from_stats(cluster.variant, prompt.agent, temperature, rep, last.stats, seconds, first or seconds)
    return replace(run, prompt_tokens=last.stats.prompt_tokens)


def read_completion_stream(lines: Iterable[bytes], clock: Callable[[], float] = time.perf_counter
                           ) -> tuple[float | None, Body, str]:
    """(when the first token's chunk arrived, the last chunk's timings, its stop type) from /completion's stream."""
    first, timings, stop = None, {}, ""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        chunk = json.loads(line[5:])
        if first is None and chunk.get("content"):
            first = clock()
        timings = chunk.get("timings", timings)
        stop = chunk.get("stop_type", stop)
    return first, timings, stop


def ask_peer(server: PeerServer, prompt: AgentPrompt, temperature: float, rep: int, max_tokens: int) -> Run:
    host, _, port = server.address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=3600)
    began = time.perf_counter()
    connection.request("POST", "/completion", json.dumps(peer_request(prompt.text, temperature, max_tokens)),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"llama-server at {server.address} answered {response.status}: {response.read()[:500]!r}")
    first, timings, stop = read_completion_stream(response)
    ended = time.perf_counter()
    connection.close()
    # stop_type "eos": the answer ended on its end-of-generation token, which predicted_n counts and duo does not
    answer = PeerAnswer(answer_tokens(timings, "stop" if stop == "eos" else "length"), ended - began,
                        (first or ended) - began, int(timings.get("draft_n", 0)),
                        int(timings.get("draft_n_accepted", 0)))
    run = run_from_answer(server.variant, prompt.agent, temperature, rep, answer)
    return replace(run, prompt_tokens=int(timings.get("prompt_n", 0)))


def measure_agents(clusters: list[Cluster | PeerServer], prompts: list[AgentPrompt], temperatures: list[float],
                   reps: int, max_tokens: int, show: Callable[[Run, str], None]) -> list[Run]:
    """Every agent's prompt at every temperature, the clusters taking turns prompt by prompt (machine noise hits
    all alike); show(run, mode) as each ends."""
    runs = []
    for rep in range(reps):
        for temperature in temperatures:
            for prompt in prompts:
                for cluster in clusters:
                    ask = ask_peer if isinstance(cluster, PeerServer) else ask_duo
                    run = replace(ask(cluster, prompt, temperature, rep, max_tokens), batch=len(runs))
                    show(run, cluster.variant.mode)
                    runs.append(run)
    return runs


def decode_rate(runs: list[Run]) -> float:
    """Tokens per second after the first token, over `runs` (0 where none decoded past it)."""
    seconds = sum(run.seconds - run.ttft for run in runs)
    return sum(run.tokens - 1 for run in runs) / seconds if seconds > 0 else 0.0


def agent_summary(runs: list[Run]) -> dict[str, dict[str, Body]]:
    """agent -> mode label -> its context in tokens, mean time to first token, decode rate, drafts accepted."""
    summary: dict[str, dict[str, Body]] = {}
    for agent in dict.fromkeys(run.prompt for run in runs):
        for label in dict.fromkeys(run.label for run in runs):
            mine = [run for run in runs if run.prompt == agent and run.label == label]
            if mine:
                summary.setdefault(agent, {})[label] = {
                    "context_tokens": max(run.prompt_tokens for run in mine),
                    "ttft_s": sum(run.ttft for run in mine) / len(mine),
                    "decode_tokens_per_second": decode_rate(mine),
                    "draft_accepted": sum(run.draft_accepted for run in mine),
                    "draft_verified": sum(run.draft_verified for run in mine)}
    return summary


def agent_table(summary: dict[str, dict[str, Body]], base: str = "llama-server") -> str:
    """The summary as a table per agent, each mode's decode rate also against `base` (llama-server alone)."""
    lines = [f"{'agent':<12}{'mode':<24}{'context':>8}{'ttft s':>9}{'decode':>8}{'vs ' + base:>20}{'accepted':>12}"]
    for agent, by_label in summary.items():
        reference = by_label.get(base, {}).get("decode_tokens_per_second")
        for label, entry in by_label.items():
            ratio = f"{entry['decode_tokens_per_second'] / reference:.2f}x" if reference else "-"
            accepted = f"{entry['draft_accepted']}/{entry['draft_verified']}"
            lines.append(f"{agent:<12}{label:<24}{entry['context_tokens']:>8}{entry['ttft_s']:>9.1f}"
                         f"{entry['decode_tokens_per_second']:>8.2f}{ratio:>20}{accepted:>12}")
    return "\n".join(lines)
