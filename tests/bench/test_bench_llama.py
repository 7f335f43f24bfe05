"""duo/bench/llama_server.py: llama.cpp's llama-server as the bench's peer, its modes' wiring, the stream it is
read from, and its numbers beside duo's. The last test runs llama-server itself on the tiny models."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from duo.bench import llama_server as bench_llama
from duo.bench import run as bench
from duo.bench.llama_server import (PeerAnswer, answer_tokens, cpu_mask, expand_modes, read_stream, run_from_answer,
                                    server_args)
from duo.bench.report import Variant, print_table, run_from_stats, summarise
from duo.bench.structured import PROMPTS, STRUCTURED, schema_json
from duo.net.listening import free_port

MODELS = (Path("/m/target.gguf"), Path("/m/draft.gguf"))


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_peers_add_llama_servers_modes_and_the_pinned_speculative_one_runs_per_draft_length():
    args = bench.parse_args(["--modes", "alone-tcores", "duo", "--peers", "--spec-n-max", "4", "8"])
    assert args.modes == ["alone-tcores", "duo", "llama-server", "llama-server-fa-off", "llama-server-all",
                          "llama-server-spec-n4", "llama-server-spec-n8", "llama-server-spec-all", "llama-server-ngram-mod",
                          "llama-server-ngram-simple", "llama-server-ngram-mod-spec"]
    assert expand_modes(["llama-server-spec"], [16]) == ["llama-server-spec-n16"]
    # llama-server has no link to delay: it runs once, with the modes that run once
    variants = bench.plan_variants(args.modes, [0, 5], None)
    assert [v.label for v in variants] == ["alone-tcores", "llama-server", "llama-server-fa-off", "llama-server-all",
                                           "llama-server-spec-n4", "llama-server-spec-n8", "llama-server-spec-all", "llama-server-ngram-mod",
                                           "llama-server-ngram-simple", "llama-server-ngram-mod-spec", "duo",
                                           "duo +5ms"]


def test_the_ngram_modes_ask_llama_server_for_its_context_drafts_alone_or_before_the_draft_model(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    args, allowed = server_args("llama-server-ngram-mod", MODELS, ({2, 3}, {0}), 8080, 1)
    assert flag(args, "--spec-type") == "ngram-mod" and "--spec-draft-model" not in args and allowed == {2, 3}
    args, allowed = server_args("llama-server-ngram-mod-spec", MODELS, ({2, 3}, {0}), 8080, 1)
    assert flag(args, "--spec-type") == "ngram-mod,draft-simple" and args.count("--spec-type") == 1
    assert flag(args, "--spec-draft-cpu-mask") == "0x1" and allowed == {0, 2, 3}


def test_llama_server_with_flash_attention_off_is_alone_on_the_target_cores(monkeypatch):
    """On a CPU llama-server's default turns flash attention on, duo's off: both are compared."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    args, allowed = server_args("llama-server-fa-off", MODELS, ({2, 3}, {0}), 8080, 1)
    assert flag(args, "--flash-attn") == "off" and "--spec-draft-model" not in args and allowed == {2, 3}
    assert "--flash-attn" not in server_args("llama-server", MODELS, ({2, 3}, {0}), 8080, 1)[0]


def test_without_peers_the_bench_builds_and_runs_no_llama_server():
    args = bench.parse_args(["--modes", "alone-tcores", "duo"])
    assert not any(bench_llama.is_peer(mode) for mode in args.modes)


def test_alone_on_the_target_cores_pins_the_threads_there(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    args, allowed = server_args("llama-server", MODELS, ({2, 3}, {0}), 8080, 1)
    assert allowed == {2, 3} and cpu_mask({2, 3}) == "0xc"
    assert flag(args, "--cpu-mask") == "0xc" and flag(args, "--cpu-mask-batch") == "0xc"
    assert flag(args, "--threads") == "2" and flag(args, "--cpu-strict") == "1"
    assert "--spec-draft-model" not in args and "--spec-type" not in args
    assert flag(args, "--port") == "8080" and flag(args, "--ctx-size") == "4096"


def test_pinned_speculation_puts_each_model_on_its_own_cores_with_the_draft_length_asked(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    args, allowed = server_args("llama-server-spec-n8", MODELS, ({1}, {0}), 8080, 4)
    assert allowed == {0, 1}
    assert flag(args, "--spec-draft-model") == "/m/draft.gguf" and flag(args, "--spec-type") == "draft-simple"
    assert flag(args, "--cpu-mask") == "0x2" and flag(args, "--spec-draft-cpu-mask") == "0x1"
    assert flag(args, "--spec-draft-cpu-mask-batch") == "0x1" and flag(args, "--spec-draft-threads") == "1"
    assert flag(args, "--spec-draft-n-max") == "8"
    assert flag(args, "--parallel") == "4" and flag(args, "--ctx-size") == str(4 * 4096)


def test_the_all_cores_modes_spread_both_models_over_every_core_unpinned(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    args, allowed = server_args("llama-server-spec-all", MODELS, ({1}, {0}), 8080, 1)
    assert allowed == {0, 1} and "--cpu-mask" not in args and "--spec-draft-cpu-mask" not in args
    assert flag(args, "--threads") == "2" and flag(args, "--spec-draft-threads") == "2"
    assert "--spec-draft-n-max" not in args  # llama-server's own default
    args, allowed = server_args("llama-server-all", MODELS, ({1}, {0}), 8080, 1)
    assert allowed == {0, 1} and "--spec-draft-model" not in args


def test_requests_ask_for_duos_sampling_without_the_prompt_cache():
    request = bench_llama.chat_request("Write a snake game.", 0.7, 96)
    assert request["messages"] == [{"role": "user", "content": "Write a snake game."}]
    assert request["cache_prompt"] is False and request["stream"] is True and request["max_tokens"] == 96
    assert (request["temperature"], request["top_k"], request["top_p"], request["min_p"]) == (0.7, 0, 1.0, 0.0)
    assert "response_format" not in request


def test_the_structured_workload_sends_the_same_schema_to_llama_server_as_to_duo():
    request = bench_llama.chat_request(STRUCTURED[0], 0.0, 96)
    assert request["messages"] == [{"role": "user", "content": PROMPTS[0]}]  # the tag is not sent
    sent = request["response_format"]["json_schema"]["schema"]
    assert json.loads(schema_json(STRUCTURED[0])) == sent and sent["required"] == ["name", "language", "functions"]
    assert schema_json(PROMPTS[0]) is None  # the same text unconstrained: the workload's baseline


def test_the_stream_gives_the_first_tokens_time_and_the_last_chunks_timings():
    ticks = iter([1.5, 9.9])
    lines = [b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n', b"\n",
             b'data: {"choices":[{"delta":{"content":"def"}}]}\n',
             b'data: {"choices":[{"delta":{"content":" snake"}}]}\n',
             b'data: {"choices":[],"usage":{"completion_tokens":3},'
             b'"timings":{"predicted_n":3,"draft_n":8,"draft_n_accepted":5}}\n',
             b"data: [DONE]\n", b'data: {"choices":[{"delta":{"content":"late"}}]}\n']
    first, timings, text, finish = read_stream(lines, clock=lambda: next(ticks))
    assert first == 1.5  # the role-only chunk carries no token
    assert text == "def snake"  # what came after [DONE] is not the answer
    assert timings == {"predicted_n": 3, "draft_n": 8, "draft_n_accepted": 5} and finish == ""


def test_an_answer_ended_by_its_end_token_counts_as_duo_counts_it_without_that_token():
    lines = [b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n',
             b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"timings":{"predicted_n":3}}\n',
             b"data: [DONE]\n"]
    first, timings, text, finish = read_stream(lines, clock=lambda: 1.0)
    assert finish == "stop" and answer_tokens(timings, finish) == 2
    assert answer_tokens({"predicted_n": 192}, "length") == 192


def _answer(tokens: int, seconds: float, ttft: float, draft_n: int = 0, accepted: int = 0) -> PeerAnswer:
    return PeerAnswer(tokens, seconds, ttft, draft_n, accepted)


def test_llama_server_numbers_stand_beside_duos_with_its_acceptance_and_the_best_draft_length(capsys):
    runs = [run_from_answer(Variant("llama-server"), "p", 0.0, 0, _answer(97, 13.0, 1.0)),
            run_from_answer(Variant("llama-server-spec-n4"), "p", 0.0, 0, _answer(97, 9.0, 1.0, 80, 60)),
            run_from_answer(Variant("llama-server-spec-n8"), "p", 0.0, 0, _answer(97, 7.0, 1.0, 120, 84))]
    stats = SimpleNamespace(generated_tokens=97, verify_steps=40, draft_tokens_received=90, draft_tokens_verified=80,
                            draft_tokens_accepted=60, draft_rejections=20, batch_sizes=[0, 10, 0, 0, 0, 30])
    runs.append(run_from_stats(Variant("duo"), "p", 0.0, 0, stats, 4.5, 0.5))
    variants = [Variant(m) for m in ("llama-server", "llama-server-spec-n4", "llama-server-spec-n8", "duo")]
    entry = summarise(runs, variants, {1: 0.1, 2: 0.15})["0.0"]
    spec = entry["modes"]["llama-server-spec-n8"]
    assert spec["acceptance_rate"] == pytest.approx(0.7)
    assert spec["token_acceptance"] is None and "ideal" not in spec  # it reports no rejections: no bound from it
    assert entry["best_llama_server_spec"] == "llama-server-spec-n8"
    ratios = entry["vs_llama_server"]
    assert ratios["llama-server"] == {"decode": 1.0, "end_to_end": 1.0}
    assert ratios["duo"]["decode"] == pytest.approx((96 / 4.0) / (96 / 12.0))
    assert ratios["duo"]["end_to_end"] == pytest.approx((97 / 4.5) / (97 / 13.0))
    print_table({"0.0": entry}, {1: 0.1, 2: 0.15}, {"cpu": "x", "cores": 2, "target_cores": [1], "draft_cores": [0]})
    table = capsys.readouterr().out
    assert "llama-server-spec-n8: draft tokens accepted / drafted 0.70" in table
    assert "duo                      / llama-server: 3.00x decode" in table
    assert "best draft length: llama-server-spec-n8" in table


@pytest.fixture(scope="module")
def llama_server() -> Path:
    """llama-server from the pinned llama.cpp, built on first use (minutes) and cached in ~/.cache/duo."""
    return bench_llama.llama_server_binary()


@pytest.mark.timeout(1800)  # a clean machine builds llama-server first (6-8 minutes on 2 idle cores)
@pytest.mark.parametrize("mode", ["llama-server", "llama-server-spec-n4"])
def test_llama_server_runs_on_the_tiny_models_and_the_speculative_mode_speculates(
        llama_server, tiny_target, tiny_draft, tmp_path, mode):
    cores = sorted(os.sched_getaffinity(0))
    variant = Variant(mode)
    server = bench_llama.start_peer(llama_server, variant, (tiny_target, tiny_draft), ({cores[-1]}, {cores[0]}),
                                    free_port(), 1, tmp_path / "server.log")
    try:
        bench_llama.wait_peer_ready(server, timeout=120)
        runs = bench.measure_batch(server, ["Write a snake game in Python."], 0.0, 0, 0, 24)
    finally:
        server.stop()
    assert len(runs) == 1 and runs[0].tokens == 24 and runs[0].mode == mode and 0 < runs[0].ttft < runs[0].seconds
    if mode == "llama-server":
        assert runs[0].draft_verified == 0
    else:  # proof that it speculated: drafts were verified, and some accepted
        assert runs[0].draft_verified > 0 and 0 < runs[0].draft_accepted <= runs[0].draft_verified


def test_one_invocation_benches_several_targets_each_in_its_folder(tmp_path):
    args = bench.parse_args(["--target", "a-f16", "a-q4", "--peers"])
    assert args.target == ["a-f16", "a-q4"]
    targets = [Path("/m/a-f16.gguf"), Path("/m/a-q4.gguf")]
    assert bench.out_folders(tmp_path, targets) == [tmp_path / "a-f16", tmp_path / "a-q4"]
    assert bench.out_folders(tmp_path, targets[:1]) == [tmp_path]  # one target: --out itself, as before
