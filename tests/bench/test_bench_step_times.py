"""duo bench's step times: each run carries where its target's decode time went, each variant and Spec-Bench group
sums it (shares of the decode time, ms per step), and the tables print it beside duo's share of the ideal and of
the pace-aware bound; bench.json carries them. No models: the runs are given."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from duo.bench import groups as bench_groups
from duo.bench import report as bench_report
from duo.bench.report import Run, Variant, run_from_stats, summarise
from duo.bench.step_times import PARTS, summarise_step_times
from duo.net._proto import duo_pb2 as pb

# T(n) of a memory-bound target: a batch of n costs little more than one.
COSTS = {n: 0.1 + 0.005 * (n - 1) for n in range(1, 9)}
DRAFT_S = 0.02


def _stats(tokens: int, steps: int, seconds: dict[str, float], round_trips: int, round_trip_s: float) -> pb.Stats:
    """A target's final Stats, as the bench receives it over gRPC."""
    return pb.Stats(generated_tokens=tokens, verify_steps=steps, draft_tokens_verified=2 * steps,
                    draft_tokens_accepted=tokens - steps, draft_rejections=steps // 2, batch_sizes=[0, 0, steps],
                    commit_round_trips=round_trips, commit_round_trip_seconds=round_trip_s,
                    **{f"step_{part}_seconds": s for part, s in seconds.items()})


def _duo_run(category: str = "", question: int = 0, *, scale: float = 1.0, round_trips: int = 4) -> Run:
    seconds = {"verify": 0.8 * scale, "check": 0.05 * scale, "work": 0.05 * scale, "drafts": 0.06 * scale,
               "queue": 0.02 * scale, "between": 0.02 * scale}
    decode = sum(seconds.values())
    run = run_from_stats(Variant("duo"), "p", 0.0, 0, _stats(40, 11, seconds, round_trips, 0.03 * round_trips),
                         decode + 0.5, 0.5)
    run.category, run.question_id, run.turn = category, question, 1 if category else 0
    return run


def _alone_run(category: str = "", question: int = 0) -> Run:
    """The target alone, as a revision before the step times reports it (llama-server's answers have none either)."""
    stats = SimpleNamespace(generated_tokens=20, verify_steps=20, draft_tokens_received=0, draft_tokens_verified=0,
                            draft_tokens_accepted=0, draft_rejections=0, batch_sizes=[0, 20])
    run = run_from_stats(Variant("alone-tcores"), "p", 0.0, 0, stats, 2.5, 0.5)
    run.category, run.question_id, run.turn = category, question, 1 if category else 0
    return run


def test_a_run_carries_its_targets_step_times_and_a_run_whose_server_does_not_say_has_none():
    run = _duo_run()
    assert set(run.step_seconds) == set(PARTS)
    assert run.step_seconds["verify"] == pytest.approx(0.8) and run.step_seconds["between"] == pytest.approx(0.02)
    assert (run.round_trips, run.round_trip_s) == (4, pytest.approx(0.12))
    alone = _alone_run()
    assert sum(alone.step_seconds.values()) == 0 and alone.round_trips == 0
    assert summarise_step_times([alone]) is None


def test_the_parts_are_summed_over_a_variants_runs_as_shares_of_the_decode_time_and_ms_per_step():
    runs = [_duo_run(scale=1.0, round_trips=4), _duo_run(scale=2.0, round_trips=2)]
    times = summarise_step_times(runs)
    decode = sum(sum(run.step_seconds.values()) for run in runs)
    steps = sum(run.verify_steps - 1 for run in runs)  # the first step's token starts the decode
    assert times["decode_s"] == pytest.approx(decode) and times["steps"] == steps
    assert sum(times["share"].values()) == pytest.approx(1.0)
    for part in PARTS:
        seconds = sum(run.step_seconds[part] for run in runs)
        assert times["share"][part] == pytest.approx(seconds / decode)
        assert times["ms_per_step"][part] == pytest.approx(1000 * seconds / steps)
    assert times["decode_ms_per_step"] == pytest.approx(1000 * decode / steps)
    assert times["round_trips"] == 6
    assert times["round_trip_ms"] == pytest.approx(1000 * sum(r.round_trip_s for r in runs) / 6)


def test_the_summary_and_bench_json_carry_the_step_times_beside_the_ideal_and_the_pace_bound():
    runs = [_duo_run(), _alone_run()]
    summary = summarise(runs, [Variant("alone-tcores"), Variant("duo")], COSTS, DRAFT_S)
    duo = json.loads(json.dumps(summary))["0.0"]["modes"]["duo"]  # as bench.json holds it
    assert duo["step_times"]["share"]["verify"] == pytest.approx(0.8)
    assert duo["ideal"]["fraction"] == pytest.approx(
        duo["decode_tokens_per_second"] / duo["ideal"]["tokens_per_second"])
    assert duo["pace_bound"]["fraction"] == pytest.approx(
        duo["decode_tokens_per_second"] / duo["pace_bound"]["tokens_per_second"])
    assert "step_times" not in summary["0.0"]["modes"]["alone-tcores"]  # its server did not say


def _row(out: str, name: str, after: str) -> list[str]:
    """The cells of the first line starting with `name` after the line containing `after`."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if after in line)
    return next(line for line in lines[start + 1:] if line.strip().startswith(name)).split()


def test_the_table_prints_each_modes_parts_and_duos_shares_of_the_bounds(capsys):
    runs = [_duo_run(), _alone_run()]
    summary = summarise(runs, [Variant("alone-tcores"), Variant("duo")], COSTS, DRAFT_S)
    bench_report.print_table(summary, COSTS, {"cpu": "test", "cores": 2, "target_cores": [1], "draft_cores": [0]})
    out = capsys.readouterr().out
    duo = summary["0.0"]["modes"]["duo"]
    cells = _row(out, "duo", "where the decode time goes")
    times = duo["step_times"]
    assert cells[1] == f"{duo['decode_tokens_per_second']:.2f}"
    assert f"({duo['ideal']['fraction']:.0%})" in cells and f"({duo['pace_bound']['fraction']:.0%})" in cells
    assert f"{duo['ideal']['tokens_per_second']:.1f}@k{duo['ideal']['best_k']}" in cells
    assert cells[cells.index(f"{times['decode_ms_per_step']:.1f}") + 1] == f"{times['ms_per_step']['verify']:.1f}"
    other = times["ms_per_step"]["queue"] + times["ms_per_step"]["between"]
    assert f"{other:.1f}" in cells and cells[-1] == f"{times['round_trip_ms']:.1f}"
    assert "rtrip" in out and "verify (llama.cpp's decode)" in out  # the legend says what the columns are


def test_duos_shares_of_the_bounds_are_printed_once_in_the_step_table_not_again_in_the_modes_row(capsys):
    runs = [_duo_run(), _alone_run()]
    summary = summarise(runs, [Variant("alone-tcores"), Variant("duo")], COSTS, DRAFT_S)
    bench_report.print_table(summary, COSTS, {"cpu": "test", "cores": 2, "target_cores": [1], "draft_cores": [0]})
    out = capsys.readouterr().out
    modes_heading = next(line for line in out.splitlines() if line.startswith("mode"))
    assert "ideal" not in modes_heading and "pace" not in modes_heading
    # The modes row: name, verification, tok/s, decode, alpha, tok/step, alone, branch, waits, wait s, dcpu, ttft,
    # then a rate per prompt.
    assert len(_row(out, "duo", "== temperature")) == 12 + len(summary["0.0"]["modes"]["duo"]["per_prompt"])
    assert f"({summary['0.0']['modes']['duo']['ideal']['fraction']:.0%})" in _row(out, "duo", "where the decode time")
    assert out.count("ideal:") == 1 and out.count("pace:") == 1  # one legend says what they are


def test_the_spec_bench_tables_give_duos_shares_of_the_bounds_and_its_parts_per_group(capsys):
    runs = [_duo_run("translation", 161), _alone_run("translation", 161),
            _duo_run("qa", 319, scale=3.0, round_trips=1), _alone_run("qa", 319)]
    variants = [Variant("alone-tcores"), Variant("duo")]
    summary = bench_groups.with_groups(summarise(runs, variants, COSTS, DRAFT_S), runs, variants, COSTS, DRAFT_S)
    bench_groups.print_groups(summary)
    out = capsys.readouterr().out
    groups = summary["0.0"]["groups"]
    for group, name in (("translation", "Translation"), ("qa", "Question Answering"), ("overall", "overall")):
        duo = groups[group]["modes"]["duo"]
        cells = _row(out, name, "duo per group")
        assert f"({duo['ideal']['fraction']:.0%})" in cells and f"({duo['pace_bound']['fraction']:.0%})" in cells
        assert f"{duo['step_times']['decode_ms_per_step']:.1f}" in cells
        assert cells[-1] == f"{duo['step_times']['round_trip_ms']:.1f}"
    # qa's decode is three times translation's in as many steps
    assert (groups["qa"]["modes"]["duo"]["step_times"]["decode_ms_per_step"]
            == pytest.approx(3 * groups["translation"]["modes"]["duo"]["step_times"]["decode_ms_per_step"]))


def test_a_duo_pair_on_the_tiny_models_tells_the_bench_where_its_decode_time_went(served_duo):
    from duo.bench.cluster import generate

    answer = generate(served_duo.address, "Write a snake game in Python.", 0.0, 24)
    run = run_from_stats(Variant("duo"), "p", 0.0, 0, answer.last.stats, answer.seconds, answer.ttft)
    assert run.tokens > 1 and run.draft_verified > 0
    assert all(seconds >= 0 for seconds in run.step_seconds.values()) and run.step_seconds["verify"] > 0
    # The target's decode, its first token to its end, lies within what its client saw of it (told a little later).
    assert 0 < sum(run.step_seconds.values()) <= run.seconds - run.ttft + 0.05
    times = summarise_step_times([run])
    assert times["steps"] == run.verify_steps - 1 and sum(times["share"].values()) == pytest.approx(1.0)
