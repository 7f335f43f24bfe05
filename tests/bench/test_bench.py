"""duo.bench without models: what runs at which link delay, the per-mode numbers, clients at once, the
baseline's code."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from duo.bench import cluster as bench_cluster
from duo.bench import concurrency as bench_concurrency
from duo.bench import machine as bench_machine
from duo.bench import report as bench_report
from duo.bench import run as bench
from duo.bench import pace_bound
from duo.bench.cluster import Code, ROOT, baseline_worktree, chat_request, spawn, split_cores
from duo.bench.groups import _bound
from duo.bench.llama_server import chat_request as peer_request
from duo.bench.report import Run, Variant, run_from_stats, summarise
from duo.net._proto import duo_pb2 as pb


def _run(mode: str, delay: float = 0.0, temperature: float = 0.0, *, tokens: int = 100, seconds: float = 10.0,
         steps: int = 50, alone_steps: int = 20, accepted: int = 60, rejections: int = 20, branch_hits: int = 5,
         waits: int = 3, wait_seconds: float = 0.25, verification: str = "") -> Run:
    batch_sizes = [0, alone_steps, steps - alone_steps]
    return Run(mode, delay, "Write a snake game.", temperature, 0, tokens, seconds, 1.0, steps, 90, 80, accepted,
               rejections, batch_sizes, branch_hits, waits, wait_seconds, verification)


def test_linked_modes_run_at_every_delay_and_the_others_once():
    variants = bench.plan_variants(["alone-tcores", "sync-split", "sync-shared", "duo"], [0, 5, 20], "duo@abc")
    assert [v.label for v in variants] == [
        "alone-tcores", "sync-shared",
        "sync-split", "duo", "duo@abc",
        "sync-split +5ms", "duo +5ms", "duo@abc +5ms",
        "sync-split +20ms", "duo +20ms", "duo@abc +20ms",
    ]


def test_duo_coupled_runs_at_every_delay_beside_duo():
    variants = bench.plan_variants(["alone-tcores", "duo", "duo-coupled"], [0, 5], "duo@abc")
    assert [v.label for v in variants] == [
        "alone-tcores", "duo", "duo-coupled", "duo@abc", "duo +5ms", "duo-coupled +5ms", "duo@abc +5ms"]
    assert "duo-coupled" in bench.MODES


def test_duo_targets_say_how_to_verify_unseeded_requests_and_the_baseline_does_not(tmp_path, monkeypatch):
    commands = {}

    def spawn(command, cores, log, code):
        commands[log.name] = command
        return SimpleNamespace()

    monkeypatch.setattr(bench_cluster, "spawn", spawn)
    models, cores = (Path("t.gguf"), Path("d.gguf")), ({1}, {0})
    for variant in (Variant("duo"), Variant("duo-coupled", 5), Variant("duo@abc"), Variant("sync-split")):
        bench_cluster.start_variant(variant, Code.at(bench_cluster.ROOT), models, cores, 4, tmp_path)

    def unseeded(log: str) -> str | None:
        command = commands[log]
        return command[command.index("--unseeded") + 1] if "--unseeded" in command else None

    assert unseeded("duo-target.log") == "residual"
    assert unseeded("duo-coupled-5ms-target.log") == "coupled"
    assert unseeded("duo-at-abc-target.log") is None
    assert unseeded("sync-split-target.log") is None


def test_the_plain_target_and_duo_nolookup_run_without_the_lookup_and_lookup_tcores_with_it(tmp_path, monkeypatch):
    commands = {}

    def spawn(command, cores, log, code):
        commands[log.name] = (command, cores)
        return SimpleNamespace()

    monkeypatch.setattr(bench_cluster, "spawn", spawn)
    models, cores = (Path("t.gguf"), Path("d.gguf")), ({1}, {0})
    for mode in ("alone-tcores", "lookup-tcores", "duo", "duo-nolookup"):
        bench_cluster.start_variant(Variant(mode), Code.at(bench_cluster.ROOT), models, cores, 4, tmp_path)
    assert "--no-lookup" in commands["alone-tcores.log"][0] and commands["alone-tcores.log"][1] == {1}
    assert "--no-lookup" not in commands["lookup-tcores.log"][0] and commands["lookup-tcores.log"][1] == {1}
    assert "--peer" not in commands["lookup-tcores.log"][0]
    assert "--no-lookup" not in commands["duo-target.log"][0]
    assert "--no-lookup" in commands["duo-nolookup-target.log"][0]
    assert {"lookup-tcores", "duo-nolookup"} <= set(bench.OPT_IN_MODES) and "edit" in bench.PROMPTS


def test_alone_rpc_runs_once_and_only_when_asked():
    variants = bench.plan_variants(["alone-tcores", "alone-rpc", "duo"], [0, 5], None)
    assert [v.label for v in variants] == ["alone-tcores", "alone-rpc", "duo", "duo +5ms"]
    assert "alone-rpc" not in bench.MODES and "alone-rpc" in bench.OPT_IN_MODES


def test_alone_rpc_starts_two_servers_on_the_target_cores_then_the_target_split_over_them(tmp_path, monkeypatch):
    started, listened = [], []

    def spawn(command, cores, log, code):
        started.append((log.name, command, cores))
        return SimpleNamespace(name=log.name)

    monkeypatch.setattr(bench_cluster, "spawn", spawn)
    monkeypatch.setattr(bench_cluster, "wait_listening",
                        lambda endpoints, servers: listened.append((len(started), endpoints, servers)))
    models, cores = (Path("t.gguf"), Path("d.gguf")), ({1}, {0})
    cluster = bench_cluster.start_variant(Variant("alone-rpc"), Code.at(bench_cluster.ROOT), models, cores, 4,
                                          tmp_path)

    assert [name for name, _, _ in started] == ["alone-rpc-server1.log", "alone-rpc-server2.log",
                                                "alone-rpc-target.log"]
    assert all(pinned == {1} for _, _, pinned in started)  # all on the target's cores, as alone-tcores
    [(servers_started, endpoints, servers)] = listened
    assert servers_started == 2 and [s.name for s in servers] == ["alone-rpc-server1.log", "alone-rpc-server2.log"]
    assert len(set(endpoints)) == 2 and all(e.startswith("127.0.0.1:") for e in endpoints)
    for (_, command, _), endpoint in zip(started[:2], endpoints):
        assert command[1:] == ["-m", "duo.cli.main", "rpc-server", "--listen", endpoint, "--device", "cpu",
                               "--threads", "1"]
    target = started[2][1]
    assert target[target.index("--rpc") + 1] == ",".join(endpoints)
    assert target[target.index("--threads") + 1] == "1" and "--peer" not in target
    assert target[target.index("--listen") + 1] == cluster.address and cluster.address not in endpoints
    assert cluster.processes[0].name == "alone-rpc-target.log"  # stopped before its servers
    assert cluster.in_turn and not cluster.speculative


def test_servers_threads_follow_the_number_of_target_cores(tmp_path, monkeypatch):
    commands = []
    monkeypatch.setattr(bench_cluster, "spawn", lambda command, cores, log, code: commands.append(command))
    monkeypatch.setattr(bench_cluster, "wait_listening", lambda endpoints, servers: None)
    bench_cluster.start_variant(Variant("alone-rpc"), Code.at(bench_cluster.ROOT), (Path("t"), Path("d")),
                                ({2, 3, 5}, {0}), 4, tmp_path)
    assert [c[c.index("--threads") + 1] for c in commands] == ["3", "3", "3"]


def test_wait_listening_waits_for_the_ports_and_stops_at_a_server_that_exits():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
        bench_cluster.wait_listening([endpoint], [SimpleNamespace(poll=lambda: None)], timeout=5)
    with pytest.raises(SystemExit, match="exited"):
        bench_cluster.wait_listening([endpoint], [SimpleNamespace(poll=lambda: 1)], timeout=5)
    with pytest.raises(SystemExit, match="did not listen"):
        bench_cluster.wait_listening([endpoint], [SimpleNamespace(poll=lambda: None)], timeout=0.3)


def test_alone_rpc_without_an_rpc_build_stops_before_anything_starts(monkeypatch):
    monkeypatch.setattr(bench_machine, "rpc_supported", lambda: False)
    with pytest.raises(SystemExit, match="without RPC"):
        bench_machine.check_modes(["alone-tcores", "alone-rpc"])
    bench_machine.check_modes(["alone-tcores", "duo"])  # no RPC needed
    monkeypatch.setattr(bench_machine, "rpc_supported", lambda: True)
    bench_machine.check_modes(["alone-tcores", "alone-rpc"])


def test_rpc_split_compares_alone_rpc_with_alone_tcores_by_decode_rate(capsys):
    # decode rate: (tokens - 1) / (seconds - ttft): 99/9 = 11 tok/s locally, 99/11 = 9 tok/s over RPC.
    runs = [_run("alone-tcores", seconds=10), _run("alone-rpc", seconds=12), _run("duo")]
    variants = bench.plan_variants(["alone-tcores", "alone-rpc", "duo"], [0], None)
    summary = summarise(runs, variants, {})
    split = summary["0.0"]["rpc_split"]
    assert split["rate"] == "decode" and (split["rpc"], split["local"]) == ("alone-rpc", "alone-tcores")
    assert split["tokens_per_second"] == pytest.approx({"rpc": 9.0, "local": 11.0, "ratio": 9 / 11})
    assert split["per_token_ms"] == pytest.approx(1000 / 9 - 1000 / 11)
    assert split["end_to_end_ratio"] == pytest.approx(10 / 12)
    bench.print_table(summary, {}, {"cpu": "cpu", "cores": 2, "target_cores": [1], "draft_cores": [0]})
    out = capsys.readouterr().out
    assert "rpc split: alone-rpc / alone-tcores = 0.82x tok/s; per-token cost of the split: +20.2 ms" in out
    assert "decode rate: 9.00 / 11.00 tok/s" in out


def test_rpc_split_needs_both_modes_and_falls_back_to_end_to_end_rates(capsys):
    summary = summarise([_run("alone-tcores"), _run("duo")], [Variant("alone-tcores"), Variant("duo")], {})
    assert summary["0.0"]["rpc_split"] is None
    bench.print_table(summary, {}, {"cpu": "cpu", "cores": 2, "target_cores": [1], "draft_cores": [0]})
    assert "rpc split" not in capsys.readouterr().out
    local = {"tokens_per_second": 10.0, "decode_tokens_per_second": None}
    split = bench_report.rpc_split({"alone-tcores": local, "alone-rpc": {**local, "tokens_per_second": 8.0}})
    assert split["rate"] == "end to end" and split["per_token_ms"] == pytest.approx(125 - 100)


def test_coupled_is_compared_with_residual_at_each_delay():
    runs = [_run("duo", temperature=0.7, seconds=10, accepted=60, rejections=20, verification="residual"),
            _run("duo-coupled", temperature=0.7, seconds=20, accepted=40, rejections=40, verification="coupled"),
            _run("duo", 5, temperature=0.7, verification="residual"),
            _run("duo-coupled", 20, temperature=0.7, verification="coupled")]
    variants = bench.plan_variants(["duo", "duo-coupled"], [0, 5, 20], None)
    entry = summarise(runs, variants, {})["0.7"]
    assert entry["modes"]["duo-coupled"]["verification"] == "coupled"
    assert entry["modes"]["duo"]["verification"] == "residual"
    assert "duo / duo-coupled" not in entry["ratios"]
    [pair] = entry["coupled_vs_residual"]  # duo-coupled +20ms has no duo +20ms
    assert (pair["coupled"], pair["residual"]) == ("duo-coupled", "duo")
    assert pair["verification"] == ["coupled", "residual"]
    assert pair["token_acceptance"] == pytest.approx({"coupled": 0.5, "residual": 0.75, "ratio": 0.5 / 0.75})
    assert pair["tokens_per_second"] == pytest.approx({"coupled": 5.0, "residual": 10.0, "ratio": 0.5})


def test_the_table_ends_with_the_coupled_residual_comparison(capsys):
    runs = [_run("duo", temperature=0.7, verification="residual"),
            _run("duo-coupled", temperature=0.7, seconds=20, verification="coupled")]
    summary = summarise(runs, [Variant("duo"), Variant("duo-coupled")], {})
    bench.print_table(summary, {}, {"cpu": "cpu", "cores": 2, "target_cores": [1], "draft_cores": [0]})
    out = capsys.readouterr().out
    assert "coupled/residual acceptance: 0.75/0.75 = 1.00x, tok/s: 5.00/10.00 = 0.50x" in out
    assert any(line.startswith("duo-coupled") and " coupled " in line for line in out.splitlines())


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
    assert (run.branch_hits, run.waits, run.wait_seconds, run.verification, run.seed) == (0, 0, 0.0, "", 0)
    assert run.label == "duo@abc +5ms" and run.batch_sizes == [0, 2, 3]


def test_runs_record_the_verification_and_seed_the_target_reports():
    stats = pb.Stats(generated_tokens=10, verification="coupled", seed=7)
    run = run_from_stats(Variant("duo-coupled"), "p", 0.7, 0, stats, 2.0, 0.5)
    assert (run.verification, run.seed) == ("coupled", 7)


def test_code_finds_the_process_modules_of_every_layout(tmp_path):
    (tmp_path / "old" / "duo").mkdir(parents=True)
    (tmp_path / "flat" / "duo").mkdir(parents=True)
    (tmp_path / "flat" / "duo" / "target_process.py").touch()
    (tmp_path / "packages" / "duo" / "cli").mkdir(parents=True)
    (tmp_path / "packages" / "duo" / "cli" / "target.py").touch()
    assert Code.at(tmp_path / "old") == Code(tmp_path / "old", "duo.target", "duo.draft")
    assert Code.at(tmp_path / "flat") == Code(tmp_path / "flat", "duo.target_process", "duo.draft_process")
    assert Code.at(tmp_path / "packages") == Code(tmp_path / "packages", "duo.cli.target", "duo.cli.draft")
    assert Code.at(ROOT).target_module == "duo.cli.target"  # this checkout


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


def _concurrent(mode: str, clients: int, batch: int, sent_s: float, seconds: float, *, tokens: int = 100,
                ttft: float = 1.0, temperature: float = 0.0) -> Run:
    run = _run(mode, temperature=temperature, tokens=tokens, seconds=seconds)
    run.ttft, run.concurrency, run.batch, run.sent_s = ttft, clients, batch, sent_s
    return run


MACHINE = {"cpu": "cpu", "cores": 2, "target_cores": [1], "draft_cores": [0]}


def test_concurrency_levels_always_include_one_and_come_in_order():
    assert bench.parse_args([]).concurrency == [1]
    assert bench.parse_args(["--concurrency", "8", "2", "4", "2"]).concurrency == [1, 2, 4, 8]
    with pytest.raises(SystemExit, match=">= 1"):
        bench.parse_args(["--concurrency", "0", "2"])


def test_targets_get_room_for_the_most_clients_and_keep_their_default_one_at_a_time(tmp_path, monkeypatch):
    assert bench.target_parallel([1]) is None and bench.target_parallel([1, 2, 8]) == 8
    commands = {}
    monkeypatch.setattr(bench_cluster, "spawn", lambda command, cores, log, code: commands.update({log.name: command}))
    models, cores = (Path("t.gguf"), Path("d.gguf")), ({1}, {0})
    bench_cluster.start_variant(Variant("duo"), Code.at(bench_cluster.ROOT), models, cores, 4, tmp_path, 8)
    bench_cluster.start_variant(Variant("alone-tcores"), Code.at(bench_cluster.ROOT), models, cores, 4, tmp_path)
    target = commands["duo-target.log"]
    assert target[target.index("--parallel") + 1] == "8"
    assert "--parallel" not in commands["alone-tcores.log"]


def test_batches_draw_prompts_round_robin_so_every_level_sends_the_same_mix():
    prompts = ["a", "b", "c"]
    assert [bench.round_robin(prompts, first, 1) for first in range(3)] == [["a"], ["b"], ["c"]]  # as without the flag
    four = [p for first in range(3) for p in bench.round_robin(prompts, first, 4)]
    assert bench.round_robin(prompts, 1, 4) == ["b", "c", "a", "b"]
    assert sorted(four) == sorted(prompts * 4)


def test_percentiles_interpolate_between_neighbours():
    values = [0.4, 0.1, 0.3, 0.2, 0.5]
    assert bench_concurrency.percentile(values, 0.5) == pytest.approx(0.3)
    assert bench_concurrency.percentile(values, 0.95) == pytest.approx(0.48)  # 0.4 + 0.8 * (0.5 - 0.4)
    assert bench_concurrency.percentile([0.7], 0.95) == pytest.approx(0.7)


def test_a_batch_lasts_from_its_first_request_sent_to_its_last_finished():
    runs = [_concurrent("duo", 2, 7, 0.0, 10.0), _concurrent("duo", 2, 7, 0.5, 12.0),
            _concurrent("duo", 2, 8, 0.0, 4.0)]
    assert bench_concurrency.batch_wall_times(runs) == pytest.approx({7: 12.5, 8: 4.0})


def test_aggregate_rate_counts_overlapping_requests_once_and_speedup_is_over_one_client():
    runs = [_concurrent("alone-tcores", 1, 0, 0.0, 10.0, ttft=0.2),
            _concurrent("alone-tcores", 1, 1, 0.0, 10.0, ttft=0.4),
            # Four at once, 100 tokens each, over 16 s of wall time: 25 tok/s against one client's 10.
            *[_concurrent("alone-tcores", 4, 2, 0.1 * i, 15.0 + 0.1 * i, ttft=t)
              for i, t in enumerate([1.0, 2.0, 3.0, 4.0])]]
    levels = bench_concurrency.summarise_levels(runs, {})
    assert list(levels) == [1, 4]
    one, four = levels[1], levels[4]
    assert one["aggregate_tokens_per_second"] == pytest.approx(10.0) and one["speedup"] == pytest.approx(1.0)
    assert (four["clients"], four["requests"], four["batches"], four["tokens"]) == (4, 4, 1, 400)
    assert four["wall_s"] == pytest.approx(0.3 + 15.3)
    assert four["aggregate_tokens_per_second"] == pytest.approx(400 / 15.6)
    assert four["speedup"] == pytest.approx(400 / 15.6 / 10.0)
    assert four["per_request_tokens_per_second"] == pytest.approx(
        {"mean": sum(100 / (15 + 0.1 * i) for i in range(4)) / 4, "min": 100 / 15.3})
    assert four["ttft_s"] == pytest.approx({"p50": 2.5, "p95": 3.85})
    assert four["token_acceptance"] == pytest.approx(0.75) and four["mean_accepted_length"] == pytest.approx(2.0)


def test_concurrency_joins_the_summary_per_temperature_and_label_and_one_client_keeps_the_modes_table():
    runs = [_concurrent(mode, clients, batch, 0.0, seconds, temperature=temperature)
            for temperature in (0.0, 0.7)
            for mode, clients, batch, seconds in [("alone-tcores", 1, 0, 10.0), ("duo", 1, 1, 5.0),
                                                  ("alone-tcores", 2, 2, 10.0), ("alone-tcores", 2, 2, 10.0),
                                                  ("duo", 2, 3, 8.0), ("duo", 2, 3, 8.0)]]
    variants = [Variant("alone-tcores"), Variant("duo")]
    summary = bench_concurrency.with_concurrency(summarise(runs, variants, {}), runs, variants, {})
    assert list(summary) == ["0.0", "0.7"]
    entry = summary["0.7"]
    assert entry["modes"]["duo"]["tokens_per_second"] == pytest.approx(20.0)  # one client at a time only
    assert entry["ratios"] == pytest.approx({"duo / alone-tcores": 2.0})
    assert list(entry["concurrency"]) == ["alone-tcores", "duo"]
    assert entry["concurrency"]["alone-tcores"][2]["speedup"] == pytest.approx(2.0)
    assert entry["concurrency"]["duo"][2]["aggregate_tokens_per_second"] == pytest.approx(25.0)
    assert entry["concurrency"]["duo"][2]["speedup"] == pytest.approx(1.25)
    dumped = json.loads(json.dumps(summary))
    assert set(dumped["0.0"]["concurrency"]["duo"]) == {"1", "2"}


def test_one_client_at_a_time_leaves_the_summary_as_it_was():
    runs, variants = [_run("alone-tcores"), _run("duo")], [Variant("alone-tcores"), Variant("duo")]
    summary = summarise(runs, variants, {})
    assert bench_concurrency.with_concurrency(summary, runs, variants, {}) == summary
    assert "concurrency" not in summary["0.0"]


def test_the_concurrency_table_says_what_several_clients_get_against_one(capsys):
    runs = [_concurrent("alone-tcores", 1, 0, 0.0, 10.0), *[_concurrent("alone-tcores", 4, 1, 0.0, 16.0)] * 4,
            _concurrent("duo", 1, 2, 0.0, 5.0), *[_concurrent("duo", 4, 3, 0.0, 10.0)] * 4]
    variants = [Variant("alone-tcores"), Variant("duo")]
    summary = bench_concurrency.with_concurrency(summarise(runs, variants, {}), runs, variants, {})
    bench_concurrency.print_concurrency(summary, {1: 0.1, 2: 0.13, 4: 0.2}, 4)
    out = capsys.readouterr().out
    assert "duo-target --parallel 4" in out
    assert "alone-tcores: 4 clients: 2.50x the aggregate of one at a time" in out
    assert "duo: 4 clients: 2.00x the aggregate of one at a time" in out
    [row] = [line for line in out.splitlines() if line.startswith("duo ")]
    assert row.split()[:4] == ["duo", "1", "20.00", "1.00x"]
    assert "2:1.30  4:2.00" in out and "2:1.54x  4:2.00x" in out  # S(m)/S(1), and m*S(1)/S(m)


def test_the_concurrency_chart_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [_concurrent("duo", 1, 0, 0.0, 10.0), *[_concurrent("duo", 2, 1, 0.0, 12.0)] * 2]
    summary = bench_concurrency.with_concurrency(summarise(runs, [Variant("duo")], {}), runs, [Variant("duo")], {})
    bench_concurrency.plot_concurrency(summary, MACHINE, tmp_path / "bench-concurrency.png")
    assert (tmp_path / "bench-concurrency.png").stat().st_size > 0


def test_requests_sent_together_are_released_at_once_and_timed_from_the_first_send(monkeypatch):
    calls = []

    def generate(address, prompt, temperature, max_tokens):
        calls.append(prompt)
        return bench_cluster.Generation(pb.GenerateResponse(), {"a": 1.0, "b": 2.0}[prompt], 0.5, prompt)

    monkeypatch.setattr(bench_cluster, "generate", generate)
    answers = bench_cluster.generate_together("127.0.0.1:1", ["a", "b"], 0.0, 8)
    assert sorted(calls) == ["a", "b"]
    assert [a.seconds for a in answers] == [1.0, 2.0] and all(a.ttft == 0.5 for a in answers)
    assert min(a.sent_s for a in answers) == 0.0 and max(a.sent_s for a in answers) < 0.5


def test_runs_record_their_batch():
    run = run_from_stats(Variant("duo"), "p", 0.0, 0, SimpleNamespace(
        generated_tokens=10, verify_steps=5, draft_tokens_received=8, draft_tokens_verified=6, draft_tokens_accepted=4,
        draft_rejections=2, batch_sizes=[0, 2, 3]), 2.0, 0.5, concurrency=4, batch=9, sent_s=0.01)
    assert (run.concurrency, run.batch, run.sent_s) == (4, 9, 0.01)
    assert _run("duo").concurrency == 1


MEMORY_BOUND = {n: 0.2 * (1 + 0.1 * (n - 1)) for n in range(1, 10)}  # T(n): a slow, memory-bound target


def test_the_pace_aware_bound_meets_the_ideal_with_a_free_draft_and_falls_as_the_draft_slows():
    ideal, _ = bench_report.ideal_rate(0.85, MEMORY_BOUND)
    free = pace_bound.pace_bound(0.85, MEMORY_BOUND, draft_s=1e-6)
    assert free.tokens_per_second == pytest.approx(ideal, rel=0.04)
    rates = [pace_bound.pace_bound(0.85, MEMORY_BOUND, draft_s=d).tokens_per_second for d in (0.01, 0.04, 0.1, 0.4)]
    assert all(later < earlier for earlier, later in zip(rates, rates[1:]))
    assert rates[0] > 0.8 * ideal  # 20 times faster than the target: a rejection costs a short wait
    # A draft slower than the target helps little: far from the ideal, never below decoding alone.
    assert 1 / MEMORY_BOUND[1] <= rates[-1] < 0.6 * ideal
    # A slow link costs the step after each rejection.
    assert pace_bound.pace_bound(0.85, MEMORY_BOUND, 0.01, link_s=0.1).tokens_per_second < rates[0]


def test_a_draft_as_fast_as_the_target_wants_its_schedule_to_wait_or_verify_less():
    slow = pace_bound.pace_bound(0.9, MEMORY_BOUND, draft_s=0.05)
    fast = pace_bound.pace_bound(0.9, MEMORY_BOUND, draft_s=0.001)
    assert slow.k <= fast.k
    assert pace_bound.simulate(0.9, MEMORY_BOUND, 0.05, 0.0, slow.k, slow.wait_s) == pytest.approx(slow.tokens_per_second)


def test_the_summary_reports_the_pace_aware_bound_and_the_drafts_cpu_share():
    runs = [_run("duo"), _run("duo")]
    for run in runs:
        run.draft_cpu_s = 2.5
    duo = summarise(runs, [Variant("duo")], MEMORY_BOUND, draft_s=0.03)["0.0"]["modes"]["duo"]
    assert duo["draft_cpu_share"] == pytest.approx(5.0 / 20.0)
    bound = duo["pace_bound"]
    assert bound["tokens_per_second"] <= duo["ideal"]["tokens_per_second"] * 1.01
    assert bound["fraction"] == pytest.approx(duo["decode_tokens_per_second"] / bound["tokens_per_second"])


def test_duo_is_asked_without_the_prompt_cache_as_llama_server_is_so_repetitions_compare_like_with_like():
    request = chat_request("hello", 0.0, 8)
    assert request.HasField("cache_prompt") and request.cache_prompt is False
    assert peer_request("hello", 0.0, 8)["cache_prompt"] is False


def test_several_drafts_are_dealt_the_draft_cores_in_turn_and_share_when_there_are_fewer():
    assert split_cores({0, 1, 2, 3}, 2) == [{0, 2}, {1, 3}]
    assert split_cores({5}, 1) == [{5}]
    assert split_cores({0}, 2) == [{0}, {0}]


def test_the_groups_table_shows_the_pace_bound_over_the_target_alone():
    modes = {"duo": {"pace_bound": {"tokens_per_second": 15.0}}, "alone-tcores": {"decode_tokens_per_second": 10.0}}
    assert _bound(modes) == "1.50x"
    assert _bound({"duo": {}, "alone-tcores": {"decode_tokens_per_second": 10.0}}) == "-"
