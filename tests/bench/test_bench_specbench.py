"""duo bench --prompts spec-bench: the questions picked per group, the two-turn conversation, the numbers per group,
the flags, without models; the last test runs one conversation through duo-target and llama-server on the tiny
models."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from duo.bench import groups as bench_groups
from duo.bench import llama_server as bench_llama
from duo.bench import run as bench
from duo.bench import specbench
from duo.bench.cluster import Cluster, chat_request
from duo.bench.report import Run, Variant, run_from_stats, summarise
from duo.bench.specbench import Question, converse, pick, read_questions
from duo.net.listening import free_port

LINES = [
    {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now make it rhyme."]},
    {"question_id": 91, "category": "roleplay", "turns": ["Be Elon Musk.", "Dance with me."]},
    {"question_id": 101, "category": "reasoning", "turns": ["Who is third?", "And second?"]},
    {"question_id": 161, "category": "translation", "turns": ["Translate: Hallo."]},
    {"question_id": 162, "category": "translation", "turns": ["Translate: Welt."]},
    {"question_id": 163, "category": "translation", "turns": ["Translate: Tschüss."]},
    {"question_id": 240, "category": "summarization", "turns": ["Summarize: a long story."]},
    {"question_id": 319, "category": "qa", "turns": ["Who wrote Faust?"], "reference": ["Goethe"]},
]


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return path


def test_the_first_n_questions_of_each_group_are_picked_in_file_order_mt_bench_counting_as_one_group(tmp_path):
    questions = read_questions(_write(tmp_path))
    assert [q.question_id for q in questions] == [line["question_id"] for line in LINES]
    assert [q.question_id for q in pick(questions, 1)] == [81, 161, 240, 319]
    assert [q.question_id for q in pick(questions, 2)] == [81, 91, 161, 162, 240, 319]
    assert {q.group for q in questions} == {"mt_bench", "translation", "summarization", "qa"}


def test_a_missing_spec_bench_file_stops_with_a_message(tmp_path):
    with pytest.raises(SystemExit, match="no Spec-Bench file"):
        read_questions(tmp_path / "absent.jsonl")


def test_the_shared_spec_bench_file_has_every_group_when_present():
    if not specbench.SPEC_BENCH.is_file():
        pytest.skip("no ../shared/data/spec-bench.jsonl beside this checkout")
    questions = read_questions(specbench.SPEC_BENCH)
    assert [q.group for q in pick(questions, 1)] == list(specbench.GROUPS)
    assert all(len(q.asked_turns()) == 2 for q in questions if q.group == "mt_bench")


def _fake_ask(asked: list):
    """A generate that answers "answer N" to its Nth turn and records the conversation it was sent."""
    def ask(text, history):
        asked.append((text, list(history)))
        return Run("duo", 0.0, text, 0.0, 0, 10, 2.0, 0.5, 5, 0, 0, 0, 0, [], 0, 0, 0.0), f"answer {len(asked)}"
    return ask


def test_an_mt_bench_question_asks_its_second_turn_after_the_models_own_first_answer():
    asked: list = []
    runs = converse(_fake_ask(asked), Question(81, "writing", ("Write a poem.", "Now make it rhyme.")))
    assert asked == [("Write a poem.", []),
                     ("Now make it rhyme.", [("user", "Write a poem."), ("assistant", "answer 1")])]
    assert [(r.turn, r.category, r.question_id) for r in runs] == [(1, "writing", 81), (2, "writing", 81)]
    assert [r.prompt for r in runs] == ["writing #81 turn 1", "writing #81 turn 2"]


def test_other_groups_ask_their_first_turn_only():
    asked: list = []
    runs = converse(_fake_ask(asked), Question(161, "translation", ("Translate: Hallo.", "A second turn.")))
    assert asked == [("Translate: Hallo.", [])] and len(runs) == 1


def test_duo_and_llama_server_are_sent_the_same_conversation():
    history = (("user", "Write a poem."), ("assistant", "Roses are red."))
    duo = chat_request("Now make it rhyme.", 0.0, 64, history=history)
    peer = bench_llama.chat_request("Now make it rhyme.", 0.0, 64, history)
    assert [(m.role, m.content) for m in duo.messages] == [(m["role"], m["content"]) for m in peer["messages"]] == [
        ("user", "Write a poem."), ("assistant", "Roses are red."), ("user", "Now make it rhyme.")]
    assert duo.max_tokens == peer["max_tokens"] == 64  # a cap: either may end earlier, at the end of its turn


def test_each_turn_is_timed_as_its_own_run_for_duo_and_for_llama_server(monkeypatch):
    peer = bench_llama.PeerServer(Variant("llama-server"), 1, None)
    sent = []

    def peer_generate(address, text, temperature, max_tokens, history):
        sent.append(list(history))
        return bench_llama.PeerAnswer(7, 1.0, 0.25, 0, 0, text=f"reply to {text}")

    monkeypatch.setattr(specbench, "peer_generate", peer_generate)
    runs = specbench.measure_questions([peer], [Question(81, "writing", ("a", "b"))], [0.0], 1, 32,
                                       lambda run, mode: None)
    assert sent == [[], [("user", "a"), ("assistant", "reply to a")]]
    assert [(r.mode, r.turn, r.tokens, r.seconds, r.ttft) for r in runs] == [("llama-server", 1, 7, 1.0, 0.25),
                                                                             ("llama-server", 2, 7, 1.0, 0.25)]
    assert runs[0].batch != runs[1].batch


def _turn(mode: str, category: str, question_id: int, turn: int, tokens: int, seconds: float) -> Run:
    stats = SimpleNamespace(generated_tokens=tokens, verify_steps=tokens, draft_tokens_received=0,
                            draft_tokens_verified=0, draft_tokens_accepted=0, draft_rejections=0, batch_sizes=[])
    run = run_from_stats(Variant(mode), "p", 0.0, 0, stats, seconds, 1.0)
    run.category, run.question_id, run.turn = category, question_id, turn
    return run


RATES = {"alone-tcores": 1.0, "llama-server": 1.0, "llama-server-spec-n4": 1.5, "llama-server-spec-all": 4.0,
         "duo": 2.0}  # tok/s per mode, all turns alike but for duo's second MT-bench turn


def _group_runs() -> list[Run]:
    runs = []
    for mode, rate in RATES.items():
        runs += [_turn(mode, "writing", 81, 1, 100, 100 / rate),
                 _turn(mode, "writing", 81, 2, 100, 100 / rate / (2 if mode == "duo" else 1)),
                 _turn(mode, "translation", 161, 1, 50, 50 / rate)]
    return runs


def test_each_group_and_overall_get_tok_s_per_mode_and_duos_ratios_to_its_peers():
    runs, variants = _group_runs(), [Variant(mode) for mode in RATES]
    groups = bench_groups.with_groups(summarise(runs, variants, {}), runs, variants, {})["0.0"]["groups"]
    assert list(groups) == ["mt_bench", "translation", "overall"]
    mt = groups["mt_bench"]
    # duo's two turns: 200 tokens in 50 + 25 s end to end; Spec-Bench's per-question mean is the same for one question
    assert mt["modes"]["duo"]["tokens_per_second"] == pytest.approx(200 / 75)
    assert mt["modes"]["duo"]["question_mean_tokens_per_second"] == pytest.approx(200 / 75)
    assert mt["ratios"]["duo / alone-tcores"] == pytest.approx(200 / 75)
    assert mt["vs_llama_server"]["duo"]["end_to_end"] == pytest.approx(200 / 75)
    # the fastest llama-server on duo's cores, not the one spread over every core
    assert mt["best_llama_server"] == "llama-server-spec-n4"
    assert mt["duo_vs_best_llama_server"] == pytest.approx(200 / 75 / 1.5)
    assert groups["translation"]["duo_vs_best_llama_server"] == pytest.approx(2.0 / 1.5)
    overall = groups["overall"]["modes"]["duo"]
    assert overall["tokens_per_second"] == pytest.approx(250 / 100)  # 250 tokens in 75 + 25 s
    assert overall["question_mean_tokens_per_second"] == pytest.approx((200 / 75 + 2.0) / 2)  # Spec-Bench's mean
    assert groups["overall"]["questions"] == 2


def test_the_bench_s_own_prompts_get_no_group_table(capsys):
    runs = [run_from_stats(Variant("duo"), "Write a snake game.", 0.0, 0, SimpleNamespace(
        generated_tokens=10, verify_steps=5, draft_tokens_received=0, draft_tokens_verified=0,
        draft_tokens_accepted=0, draft_rejections=0, batch_sizes=[]), 2.0, 0.5)]
    summary = bench_groups.with_groups(summarise(runs, [Variant("duo")], {}), runs, [Variant("duo")], {})
    assert "groups" not in summary["0.0"]
    bench_groups.print_groups(summary)
    assert capsys.readouterr().out == ""


def test_the_group_table_names_spec_benchs_groups_and_duos_ratios(capsys):
    runs, variants = _group_runs(), [Variant(mode) for mode in RATES]
    bench_groups.print_groups(bench_groups.with_groups(summarise(runs, variants, {}), runs, variants, {}))
    out = capsys.readouterr().out
    assert "Multi-turn Conversation" in out and "Translation" in out and "overall" in out
    mt_row = next(line for line in out.splitlines() if line.startswith("Multi-turn Conversation"))
    assert "2.67x" in mt_row and "1.78x" in mt_row and mt_row.endswith("llama-server-spec-n4")


def test_the_spec_bench_flags_are_parsed_with_the_shared_file_and_one_question_per_group_by_default(tmp_path):
    args = bench.parse_args([])
    assert args.prompts == "all"  # all stays the bench's code and chat prompts
    assert args.spec_bench == bench.ROOT.parent / "shared" / "data" / "spec-bench.jsonl" and args.per_group == 1
    path = _write(tmp_path)
    args = bench.parse_args(["--prompts", "spec-bench", "--per-group", "3", "--spec-bench", str(path)])
    assert (args.prompts, args.per_group, args.spec_bench) == ("spec-bench", 3, path)


def test_spec_bench_refuses_a_missing_file_no_questions_per_group_and_clients_at_once(tmp_path):
    path = str(_write(tmp_path))
    with pytest.raises(SystemExit, match="no Spec-Bench file"):
        bench.parse_args(["--prompts", "spec-bench", "--spec-bench", str(tmp_path / "absent.jsonl")])
    with pytest.raises(SystemExit, match="--per-group"):
        bench.parse_args(["--prompts", "spec-bench", "--spec-bench", path, "--per-group", "0"])
    with pytest.raises(SystemExit, match="one conversation at a time"):
        bench.parse_args(["--prompts", "spec-bench", "--spec-bench", path, "--concurrency", "2"])
    assert bench.parse_args(["--prompts", "code", "--per-group", "0"]).per_group == 0  # only spec-bench reads it


def test_the_workload_reads_spec_bench_and_runs_its_conversations(tmp_path, monkeypatch):
    measured = {}
    monkeypatch.setattr(bench, "warm_up", lambda clusters, prompt: measured.setdefault("warm", prompt))
    monkeypatch.setattr(bench, "measure_questions", lambda clusters, questions, *rest: measured.setdefault(
        "questions", [q.question_id for q in questions]))
    args = bench.parse_args(["--prompts", "spec-bench", "--per-group", "2", "--spec-bench", str(_write(tmp_path))])
    bench.measure_workload([], args, tmp_path / "never-loaded.gguf")
    assert measured == {"warm": "Write a poem.", "questions": [81, 91, 161, 162, 240, 319]}


@pytest.mark.timeout(1800)  # a clean machine builds llama-server first (6-8 minutes on 2 idle cores)
def test_duo_and_llama_server_answer_both_turns_on_the_tiny_models(served_alone, tiny_target, tiny_draft, tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    server = bench_llama.start_peer(bench_llama.llama_server_binary(), Variant("llama-server"),
                                    (tiny_target, tiny_draft), ({cores[-1]}, {cores[0]}), free_port(), 1,
                                    tmp_path / "server.log")
    try:
        bench_llama.wait_peer_ready(server, timeout=120)
        duo = Cluster(Variant("alone-tcores"), served_alone.address)
        runs = specbench.measure_questions([duo, server], [Question(81, "writing", ("Write a poem.", "Shorter."))],
                                           [0.0], 1, 12, lambda run, mode: None)
    finally:
        server.stop()
    assert [(r.mode, r.turn) for r in runs] == [("alone-tcores", 1), ("alone-tcores", 2), ("llama-server", 1),
                                                ("llama-server", 2)]
    assert all(0 < r.tokens <= 12 and 0 < r.ttft <= r.seconds for r in runs)
