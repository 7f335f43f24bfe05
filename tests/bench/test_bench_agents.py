"""duo bench --prompts agent: each agent's chat as the bench reads it (tests/bench/test_agent_chats.py: the API's
translation of its captured body), the flags, the table per agent, without models; the last test sends one rendered
prompt to duo-target and to llama-server on the tiny models, which read the same tokens."""

from __future__ import annotations

import json
import os

import pytest

from duo.bench import agents
from duo.bench import llama_server as bench_llama
from duo.bench import run as bench
from duo.bench.agents import AgentPrompt, agent_summary, agent_table, read_agent_prompts, render
from duo.bench.cluster import Cluster
from duo.bench.report import Run, Variant
from duo.net.listening import free_port


def test_the_agents_first_requests_are_read_as_chats_with_their_default_tools():
    codex, claude_code, qwen_code, opencode = read_agent_prompts()
    assert [p.agent for p in (codex, claude_code, qwen_code, opencode)] == ["codex", "claude_code", "qwen_code",
                                                                           "opencode"]
    for prompt in (codex, claude_code, qwen_code, opencode):
        assert prompt.messages[-1]["role"] == "user" or prompt.agent == "claude_code"
        assert all(isinstance(message["content"], str) for message in prompt.messages)
        assert "create hello.py that prints hello" in "".join(m["content"] for m in prompt.messages)
        assert prompt.tools and all(tool["type"] == "function" and "parameters" in tool["function"]
                                    for tool in prompt.tools)
    body = json.loads((agents.AGENT_PROMPTS / "claude_code.json").read_text())
    assert len(claude_code.tools) == sum("input_schema" in tool for tool in body["tools"])


def prose(value: object) -> list[str]:
    """Every string in a JSON value."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for item in value.values() for text in prose(item)]
    return [text for item in value for text in prose(item)] if isinstance(value, list) else []


def test_claude_codes_body_keeps_its_shape_but_none_of_anthropics_prose():
    """Claude Code is Anthropic's, all rights reserved: its system prompt, reminders and tool descriptions are
    replaced by neutral text of about the same length; its structure, tool names and schemas' shape are kept."""
    body = json.loads((agents.AGENT_PROMPTS / "claude_code.json").read_text())
    texts = prose({key: body[key] for key in ("system", "messages", "tools")})
    assert not [text for text in texts if "Anthropic" in text or "Claude" in text]
    assert len(body["tools"]) == 24 and all(tool["input_schema"]["type"] == "object" for tool in body["tools"])
    assert "<system-reminder>" in body["messages"][0]["content"][0]["text"]


def test_agents_picks_whose_requests_are_sent_in_table_order():
    """A CPU core reads each agent's prompt for minutes per server: --agents runs some of them."""
    args = bench.parse_args(["--prompts", "agent", "--agents", "qwen_code", "codex"])
    assert [prompt.agent for prompt in read_agent_prompts(agents=args.agents)] == ["codex", "qwen_code"]
    assert bench.parse_args(["--prompts", "agent"]).agents == ["codex", "claude_code", "qwen_code", "opencode"]


def test_a_missing_agent_chat_says_which_script_writes_it(tmp_path):
    with pytest.raises(SystemExit, match="codex.chat.json.*scripts/agent_chats.py"):
        read_agent_prompts(tmp_path)


def test_prompts_agent_is_a_workload_of_one_request_at_a_time():
    assert bench.parse_args(["--prompts", "agent"]).prompts == "agent"
    with pytest.raises(SystemExit, match="one request at a time"):
        bench.parse_args(["--prompts", "agent", "--concurrency", "2"])


def test_llama_servers_completion_stream_gives_the_first_tokens_time_and_the_last_timings():
    clock = iter([1.0, 2.0, 3.0])
    lines = [b'data: {"content": "", "stop": false}', b'data: {"content": "Hi", "stop": false}',
             b'data: {"content": "", "stop": true, "stop_type": "eos", "timings": {"prompt_n": 9, "predicted_n": 3}}']
    first, timings, stop = agents.read_completion_stream(lines, clock=lambda: next(clock))
    assert (first, timings["prompt_n"], stop) == (1.0, 9, "eos")


def run(mode: str, agent: str, *, tokens: int, seconds: float, ttft: float, context: int) -> Run:
    return Run(mode, 0.0, agent, 0.0, 0, tokens, seconds, ttft, 0, 0, 0, 0, 0, [], 0, 0, 0.0, prompt_tokens=context)


def test_the_agent_table_gives_each_modes_context_first_token_and_decode_rate_against_llama_server():
    runs = [run("llama-server", "codex", tokens=11, seconds=12.0, ttft=10.0, context=8603),
            run("duo", "codex", tokens=16, seconds=13.0, ttft=10.0, context=8603)]
    summary = agent_summary(runs)
    assert summary["codex"]["llama-server"]["decode_tokens_per_second"] == pytest.approx(5.0)
    assert summary["codex"]["duo"] == pytest.approx({"context_tokens": 8603, "ttft_s": 10.0,
                                                     "decode_tokens_per_second": 5.0, "draft_accepted": 0,
                                                     "draft_verified": 0})
    duo_line = next(line for line in agent_table(summary).splitlines() if " duo " in line)
    assert "8603" in duo_line and "1.00x" in duo_line


def test_the_agents_table_goes_beside_the_summary_whose_entries_stay_temperatures():
    """The summary's printers read each entry as a temperature's table of modes: an "agents" entry among them
    stopped the bench after the agents' runs (KeyError: 'modes')."""
    report = {"summary": {"0.0": {"modes": {}, "ratios": {}}}}
    bench.add_agents(report, [run("duo", "codex", tokens=16, seconds=13.0, ttft=10.0, context=8603)])
    assert list(report["summary"]) == ["0.0"] and report["agents"]["codex"]["duo"]["context_tokens"] == 8603
    bench.print_table(report["summary"], {}, {"cpu": "x", "cores": 2, "target_cores": [1], "draft_cores": [0]})


@pytest.mark.timeout(1800)  # a clean machine builds llama-server first (6-8 minutes on 2 idle cores)
def test_duo_and_llama_server_read_the_same_rendered_agent_prompt_on_the_tiny_models(served_alone, tiny_target,
                                                                                    tiny_draft, tmp_path):
    prompt = AgentPrompt("qwen_code", [{"role": "system", "content": "You write code."},
                                       {"role": "user", "content": "create hello.py that prints hello"}],
                         [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}])
    [prompt] = agents.render_with_model([prompt], tiny_target)
    cores = sorted(os.sched_getaffinity(0))
    server = bench_llama.start_peer(bench_llama.llama_server_binary(), Variant("llama-server"),
                                    (tiny_target, tiny_draft), ({cores[-1]}, {cores[0]}), free_port(), 1,
                                    tmp_path / "server.log", context=1024)
    try:
        bench_llama.wait_peer_ready(server, timeout=120)
        duo = Cluster(Variant("alone-tcores"), served_alone.address)
        runs = agents.measure_agents([duo, server], [prompt], [0.0], 1, 12, lambda run, mode: None)
    finally:
        server.stop()
    assert [r.mode for r in runs] == ["alone-tcores", "llama-server"]
    assert runs[0].prompt_tokens == runs[1].prompt_tokens > 20  # the same tokens, tools and all
    assert all(0 < r.tokens <= 12 and 0 < r.ttft <= r.seconds for r in runs)


def test_render_gives_each_prompt_its_templates_text():
    [prompt] = render([AgentPrompt("claude_code", [{"role": "user", "content": "hi"}], [], {"enable_thinking": True})],
                      lambda messages, tools, variables: f"<{messages[0]['content']}|{len(tools)}|{variables}>")
    assert prompt.text == "<hi|0|{'enable_thinking': True}>"
