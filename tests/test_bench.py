"""scripts/bench*.py without models: what runs at which link delay, the per-mode numbers, the baseline's code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench  # noqa: E402
from bench_cluster import Code, baseline_worktree, spawn  # noqa: E402
from bench_report import Run, Variant, run_from_stats, summarise  # noqa: E402


def _run(mode: str, delay: float = 0.0, temperature: float = 0.0, *, tokens: int = 100, seconds: float = 10.0,
         steps: int = 50, alone_steps: int = 20, accepted: int = 60, rejections: int = 20, branch_hits: int = 5,
         waits: int = 3, wait_seconds: float = 0.25) -> Run:
    batch_sizes = [0, alone_steps, steps - alone_steps]
    return Run(mode, delay, "Write a snake game.", temperature, 0, tokens, seconds, 1.0, steps, 90, 80, accepted,
               rejections, batch_sizes, branch_hits, waits, wait_seconds)


def test_linked_modes_run_at_every_delay_and_the_others_once():
    variants = bench.plan_variants(["alone-tcores", "sync-split", "sync-shared", "duo"], [0, 5, 20], "duo@abc")
    assert [v.label for v in variants] == [
        "alone-tcores", "sync-shared",
        "sync-split", "duo", "duo@abc",
        "sync-split +5ms", "duo +5ms", "duo@abc +5ms",
        "sync-split +20ms", "duo +20ms", "duo@abc +20ms",
    ]


def test_summary_reports_alone_share_branch_hit_rate_waits_and_tokens_per_step():
    runs = [_run("duo"), _run("duo", branch_hits=15, waits=1, wait_seconds=0.5)]
    duo = summarise(runs, [Variant("duo")], {1: 0.1, 2: 0.12})["0.0"]["modes"]["duo"]
    assert duo["alone_share"] == pytest.approx(40 / 100)  # batch_sizes[1] / verify steps
    assert duo["branch_hit_rate"] == pytest.approx(20 / 40)  # branch hits / rejections
    assert duo["waits"] == 4 and duo["wait_seconds"] == pytest.approx(0.75)
    assert duo["mean_accepted_length"] == pytest.approx(200 / 100)
    assert duo["token_acceptance"] == pytest.approx(120 / 160)
    assert duo["ideal"]["best_k"] == 1 and 0 < duo["ideal"]["fraction"] < 1


def test_duo_is_compared_with_the_modes_at_its_own_delay_and_with_those_without_a_link():
    runs = [_run("alone-tcores", seconds=20), _run("duo"), _run("duo", 5, seconds=12.5), _run("duo@abc", 5, seconds=25),
            _run("sync-split", 5, seconds=50), _run("sync-split", 0, seconds=40)]
    variants = bench.plan_variants(["alone-tcores", "sync-split", "duo"], [0, 5], "duo@abc")
    ratios = summarise(runs, variants, {})["0.0"]["ratios"]
    assert ratios == pytest.approx({
        "duo / alone-tcores": 2.0, "duo / sync-split": 4.0,
        "duo +5ms / alone-tcores": 1.6, "duo +5ms / sync-split +5ms": 4.0, "duo +5ms / duo@abc +5ms": 2.0,
    })


def test_each_temperature_is_summarised_apart():
    runs = [_run("duo", temperature=0.0, seconds=10), _run("duo", temperature=0.7, seconds=20)]
    summary = summarise(runs, [Variant("duo")], {})
    assert list(summary) == ["0.0", "0.7"]
    assert summary["0.0"]["modes"]["duo"]["tokens_per_second"] == pytest.approx(10)
    assert summary["0.7"]["modes"]["duo"]["tokens_per_second"] == pytest.approx(5)


def test_stats_of_a_revision_without_branches_or_waits_read_as_zero():
    old = SimpleNamespace(generated_tokens=10, verify_steps=5, draft_tokens_received=8, draft_tokens_verified=6,
                          draft_tokens_accepted=4, draft_rejections=2, batch_sizes=[0, 2, 3])
    run = run_from_stats(Variant("duo@abc", 5), "p", 0.0, 0, old, 2.0, 0.5)
    assert (run.branch_hits, run.waits, run.wait_seconds) == (0, 0, 0.0)
    assert run.label == "duo@abc +5ms" and run.batch_sizes == [0, 2, 3]


def test_code_finds_the_process_modules_of_either_layout(tmp_path):
    (tmp_path / "old" / "duo").mkdir(parents=True)
    (tmp_path / "new" / "duo").mkdir(parents=True)
    (tmp_path / "new" / "duo" / "target_process.py").touch()
    assert Code.at(tmp_path / "old") == Code(tmp_path / "old", "duo.target", "duo.draft")
    assert Code.at(tmp_path / "new") == Code(tmp_path / "new", "duo.target_process", "duo.draft_process")


def test_processes_of_a_baseline_import_its_duo_not_the_installed_one(tmp_path):
    (tmp_path / "duo").mkdir()
    (tmp_path / "duo" / "__init__.py").touch()
    (tmp_path / "duo" / "whoami.py").write_text("import duo; print(duo.__file__)\n")
    log = tmp_path / "log"
    process = spawn([sys.executable, "-m", "duo.whoami"], set(os.sched_getaffinity(0)), log, Code.at(tmp_path))
    assert process.wait(30) == 0
    assert log.read_text().strip() == str(tmp_path / "duo" / "__init__.py")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def test_baseline_worktree_checks_out_the_revision_and_is_removed_afterwards(tmp_path):
    repo = tmp_path / "repo"
    (repo / "duo").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "duo" / "target.py").write_text("old layout\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "old")
    first = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "duo" / "target_process.py").write_text("new layout\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "new")

    with baseline_worktree(first[:7], repo) as (code, commit):
        assert commit == first
        assert code.target_module == "duo.target" and (code.root / "duo" / "target.py").is_file()
        tree = code.root
    assert not tree.exists() and not tree.parent.exists()
    assert _git(repo, "worktree", "list").count("\n") == 1
