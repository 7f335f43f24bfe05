r"""Benchmark duo against its peers side by side, in one run: the target alone, synchronous speculation, duo.

Modes, alternated within each repetition so that machine noise hits all of them alike:
  alone-tcores   duo-target without a draft, on the target's cores            (a)
  alone-all      duo-target without a draft, on all cores                     (a)
  sync-split     llama.cpp's classic loop (draft K, verify), draft and target
                 on their own cores, taking turns                             (b)
  sync-shared    the same loop, both models using all cores                   (b')
  duo            duo-draft and duo-target, each pinned to its own cores,
                 duo-target verifying sampled drafts by residual rejection
                 sampling (--unseeded residual)                               (c)
  duo-coupled    the same, by coupled sampling (--unseeded coupled)           (c')
  duo@REV        duo as of git revision REV (--baseline-rev), run from a temporary worktree
                 (its duo-target's default verification: no --unseeded)
  alone-rpc      duo-target without a draft, its layers split evenly over two local
                 `duo rpc-server`s (--rpc); the servers and the target all on the
                 target's cores, as alone-tcores: the difference is the split's cost
                 (RPC round trips per layer group). Opt-in (not in the default
                 --modes): it needs llama-cpp-python built with RPC              (a')
  llama-server, llama-server-all, llama-server-spec, llama-server-spec-all
                 llama.cpp's own server, alone and with its speculative decoding, built once
                 from the same pinned llama.cpp (duo/bench/llama_server.py says how each is pinned;
                 --peers adds all four; llama-server-spec runs once per --spec-n-max and the best
                 is named). Every variant is also compared with llama-server alone on the
                 target's cores, by the decode rate and end to end.
--link-delay-ms D1 D2 ... runs the modes that talk over the target-draft link (sync-split, duo,
duo-coupled, duo@REV) once per one-way delay, through duo/bench/delay_proxy.py (0: a direct
connection): a network between the two machines, as in duo's mission (a fast draft, a slow target).

Requests carry no seed (but the warm-up's), so each duo-target verifies sampled requests as its
--unseeded says (a seeded request is always coupled); each run records the verification the target
reports and the seed it drew.

It also measures the target's verify cost curve T(n) (a batch of n tokens) on the target's cores
and, per speculative mode, the ideal bound max_k E[tokens per verify](k) / T(k+1) from that mode's
measured acceptance, and the share of it reached, beside where each target's decode time went
(duo/bench/step_times.py: ms per step and share, per part; bench.json summary[T]["modes"][label]
["step_times"]; per Spec-Bench group, duo's). Per mode: tok/s, per-token acceptance, tokens per verify step,
the share of steps decoded alone, the branch hit rate after rejections, the target's waits for the draft.
Where duo and duo-coupled both ran, each temperature's table ends with
"coupled/residual acceptance: ..., tok/s: ..." per link delay: coupled's numbers, residual's and
their ratio. Where alone-tcores and alone-rpc both ran, it ends with "rpc split: alone-rpc /
alone-tcores = X.XXx tok/s; per-token cost of the split: +Y ms" (by the decode rate, after the first
token), also in bench.json as summary[T]["rpc_split"]. Writes bench.json and bench.png to --out,
prints a table per temperature.

--concurrency C1 C2 ... also sends C requests at once, by C clients released together, at each
level C (1 always runs: the speedups are against it). At level C, each prompt in turn leads a batch
of C prompts drawn round-robin from the set, so every level sends the same mix (at C = 1: each
prompt once, as without the flag); the modes still take turns, batch by batch. Every duo-target
runs with --parallel max(C), so no request waits inside it for a turn (and duo-draft drafts up to
16 sessions per target: beyond, requests decode alone). Per mode and level: the aggregate tok/s (all
tokens / wall time from a batch's first request sent to its last finished, summed over batches),
per-request tok/s (mean and min), TTFT p50 and p95 measured by the client (send to first token),
acceptance and tokens per step over all the level's requests, and the speedup over one client:
"duo: 2 clients: 1.60x, 4 clients: 2.10x the aggregate of one at a time". In bench.json:
summary[T]["concurrency"][label][C], and "sequence_costs_s": S(m), the target decoding one token for
each of m sequences in one call on its cores, for m up to max(C); m*S(1)/S(m) bounds the target
alone's speedup. The chart of aggregate tok/s against clients goes to bench-concurrency.png.

--prompts spec-bench asks Spec-Bench's questions (--spec-bench PATH, --per-group N; duo/bench/specbench.py),
MT-bench's as two-turn chats, and adds a table per task group and overall (duo/bench/groups.py), in
bench.json as summary[T]["groups"][group].

--prompts agent sends the first request of Codex CLI, Claude Code and Qwen Code (8.6k, 18.8k and 14.6k tokens
once rendered by Qwen2.5-Coder's template; duo/bench/agents.py), one at a time, every server with the model's
whole context, and adds a table per agent: context, time to first token, decode rate against llama-server
alone (bench.json "agents").

Example (2 cores: draft on core 0, target on core 1; F32 target = a slow, memory-bound target):
  duo bench --target qwen2.5-coder-1.5b-instruct-f32 --draft qwen2.5-coder-0.5b-instruct \
      --draft-cores 0 --target-cores 1 --prompts code --temperatures 0 0.7 --reps 2 \
      --link-delay-ms 0 5 20 --baseline-rev main

Coupled against residual verification of sampled drafts (greedy is the same in both):
  duo bench --target qwen2.5-coder-1.5b-instruct-f32 --draft qwen2.5-coder-0.5b-instruct \
      --draft-cores 0 --target-cores 1 --modes alone-tcores duo duo-coupled --prompts all \
      --temperatures 0.7 1.0 --reps 3

The cost of splitting the target over RPC servers, on the same cores (needs an RPC build):
  duo bench --target qwen2.5-coder-1.5b-instruct --target-cores 1 \
      --modes alone-tcores alone-rpc --temperatures 0

duo beside llama.cpp's llama-server, alone and speculative, on the same two cores, F16 then Q4_K_M target
(their results in --out/<target>/):
  duo bench --target qwen2.5-coder-1.5b-instruct-f16 qwen2.5-coder-1.5b-instruct \
      --draft qwen2.5-coder-0.5b-instruct \
      --draft-cores 0 --target-cores 1 --modes alone-tcores duo --peers --prompts code \
      --temperatures 0 0.7 --reps 1 --max-tokens 96

Spec-Bench's task groups (one question each, MT-bench's as two turns), beside llama-server alone, its draft-model
speculation (draft-simple) and ngram-mod before the draft model (ngram-mod,draft-simple):
  duo bench --target qwen2.5-coder-1.5b-instruct-f16 --draft qwen2.5-coder-0.5b-instruct --draft-cores 0 \
      --target-cores 1 --modes alone-tcores duo llama-server llama-server-spec llama-server-ngram-mod-spec \
      --spec-n-max 4 --prompts spec-bench --per-group 1 --temperatures 0 --reps 1 --max-tokens 256

1, 2, 4 and 8 clients at once, against the target alone and duo:
  duo bench --target qwen2.5-coder-1.5b-instruct-f16 --draft qwen2.5-coder-0.5b-instruct \
      --draft-cores 0 --target-cores 1 --modes alone-tcores duo --prompts code --temperatures 0 \
      --concurrency 1 2 4 8 --reps 1 --max-tokens 96
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
from dataclasses import asdict
from pathlib import Path

from duo.bench.agents import AGENT_CONTEXT, AGENTS, agent_summary, agent_table, measure_agents, read_agent_prompts
from duo.bench.agents import render_with_model
from duo.bench.cluster import (
    ROOT,
    UNSEEDED,
    Cluster,
    Code,
    baseline_worktree,
    generate,
    generate_together,
    start_variant,
    wait_ready,
)
from duo.bench.concurrency import batch_wall_times, plot_concurrency, print_concurrency, with_concurrency
from duo.bench.llama_server import (
    CONTEXT,
    PEER_MODES,
    PeerServer,
    expand_modes,
    is_peer,
    llama_server_binary,
    peer_generate,
    peer_generate_together,
    run_from_answer,
    start_peer,
    wait_peer_ready,
)
from duo.bench.edit import PROMPTS as EDIT_PROMPTS
from duo.bench.machine import check_modes, machine_info, this_commit
from duo.bench.groups import print_groups, with_groups
from duo.bench.specbench import add_spec_bench_arguments, check_spec_bench_arguments, measure_questions, pick
from duo.bench.specbench import read_questions
from duo.bench.structured import PROMPTS as PROMPTS_FREE
from duo.bench.structured import STRUCTURED
from duo.bench.report import UNDELAYED_MODES, Run, Variant, plot, print_table, run_from_stats, summarise
from duo.bench.timing import measure_sequence_costs, measure_verify_costs
from duo.models import hub
from duo.net.listening import free_port

PROMPTS = {
    # As in the community tests of llama-server's speculative decoding.
    "code": ["Write a snake game in Python.", "Write a snake game in TypeScript.", "Write a snake game in Swift."],
    "chat": ["Explain, in a few paragraphs, why the sky is blue and why sunsets are red.",
             "Describe the history of the printing press and its effect on Europe."],
    # Answers that must match a JSON schema (duo.bench.structured), the same schema for every mode.
    "structured": STRUCTURED + PROMPTS_FREE,
    # Code given and changed: most of the answer is in the prompt (duo.bench.edit).
    "edit": EDIT_PROMPTS,
}
MODES = ("alone-tcores", "alone-all", "sync-split", "sync-shared", "duo", "duo-coupled")  # the default --modes
# Run only when --modes names them: the target split over RPC; the context lookup alone (no draft) and duo without it.
OPT_IN_MODES = ("alone-rpc", "lookup-tcores", "duo-nolookup")


def plan_variants(modes: list[str], delays: list[float], baseline_mode: str | None) -> list[Variant]:
    """What to run, in table order: the modes without a delayed link once, then at each link delay
    the modes that use it (sync-split, duo, duo-coupled, and the baseline's duo after them)."""
    undelayed = [m for m in modes if m in UNDELAYED_MODES or is_peer(m)]
    linked = [m for m in modes if m not in undelayed]
    if baseline_mode:
        linked.append(baseline_mode)
    return [Variant(m) for m in undelayed] + [Variant(m, delay) for delay in delays for m in linked]


def round_robin(prompts: list[str], first: int, count: int) -> list[str]:
    """`count` prompts, from prompts[first] on, starting over at the end of the list."""
    return [prompts[(first + i) % len(prompts)] for i in range(count)]


def measure(clusters: list[Cluster | PeerServer], args: argparse.Namespace, prompts: list[str]) -> list[Run]:
    """At every temperature and concurrency level C, a batch of C prompts led by each prompt in turn
    (round_robin), sent at once to every cluster, the clusters taking turns within each repetition so
    that machine noise hits all of them alike. Requests carry no seed: each target verifies sampled
    ones as its --unseeded says."""
    warm_up(clusters, prompts[0])
    runs = []
    batches = itertools.count()
    for rep in range(args.reps):
        for temperature in args.temperatures:
            for clients in args.concurrency:
                for first in range(len(prompts)):
                    for cluster in clusters:
                        runs += measure_batch(cluster, round_robin(prompts, first, clients), temperature, rep,
                                              next(batches), args.max_tokens)
    return runs


def warm_up(clusters: list[Cluster | PeerServer], prompt: str) -> None:
    """Each cluster ready, then its caches warmed by a short answer to `prompt`."""
    for cluster in clusters:
        if isinstance(cluster, PeerServer):
            wait_peer_ready(cluster)
            peer_generate(cluster.address, prompt, 0.0, 16)
        else:
            wait_ready(cluster)
            generate(cluster.address, prompt, 0.0, 16, 0)


def measure_batch(cluster: Cluster | PeerServer, prompts: list[str], temperature: float, rep: int, batch: int,
                  max_tokens: int) -> list[Run]:
    """The prompts sent to `cluster` at once, a client each; a Run per request."""
    if isinstance(cluster, PeerServer):
        runs = [run_from_answer(cluster.variant, prompt, temperature, rep, answer, concurrency=len(prompts),
                                batch=batch)
                for prompt, answer in zip(prompts, peer_generate_together(cluster.address, prompts, temperature,
                                                                          max_tokens))]
    else:
        cpu_before = cluster.draft_cpu_seconds()
        runs = [run_from_stats(cluster.variant, prompt, temperature, rep, answer.last.stats, answer.seconds,
                               answer.ttft, concurrency=len(prompts), batch=batch, sent_s=answer.sent_s)
                for prompt, answer in zip(prompts, generate_together(cluster.address, prompts, temperature,
                                                                     max_tokens))]
        if cpu_before is not None:
            for run in runs:
                run.draft_cpu_s = (cluster.draft_cpu_seconds() - cpu_before) / len(runs)
    for run in runs:
        show_run(run, cluster.variant.mode)
    if len(runs) > 1:
        print(f"  {len(runs)} at once: {sum(r.tokens for r in runs) / batch_wall_times(runs)[batch]:.2f} tok/s "
              f"in all", file=sys.stderr)
    return runs


def show_run(run: Run, mode: str) -> None:
    """A run's line on stderr as it ends, and a warning where its target verified otherwise than `mode` asks."""
    clients = f"C={run.concurrency} " if run.concurrency > 1 else ""
    print(f"rep {run.rep} T={run.temperature} {clients}{run.label:<24} {run.verification or '-':<8} "
          f"{run.tokens_per_second:6.2f} tok/s ({run.tokens} tokens, accepted "
          f"{run.draft_accepted}/{run.draft_verified}) {run.prompt[:40]}", file=sys.stderr)
    warn_unexpected_verification(run, mode)


def warn_unexpected_verification(run: Run, mode: str) -> None:
    """A warning where the target verified otherwise than the mode asks (greedy at temperature 0)."""
    expected = (UNSEEDED[mode] if run.temperature > 0 else "greedy") if mode in UNSEEDED else None
    if expected and run.verification != expected:
        print(f"  warning: {run.label} verified {run.verification or 'without saying how'}, not {expected}",
              file=sys.stderr)


def stop_all(clusters: list[Cluster | PeerServer]) -> None:
    for cluster in clusters:
        cluster.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duo bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(parser)
    return parser


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's flags, on its own parser (scripts/bench.py) or on `duo bench`'s."""
    parser.add_argument("--target", nargs="+", default=[hub.DEFAULT_TARGET],
                        help="target model(s): name or path; several run one after the other, each with its "
                             "tables and its folder under --out")
    parser.add_argument("--draft", default=hub.CPU_DRAFT,
                        help="draft model: name or path (default: %(default)s, duo-draft's default on a CPU)")
    parser.add_argument("--target-cores", type=int, nargs="+", default=[1])
    parser.add_argument("--draft-cores", type=int, nargs="+", default=[0])
    parser.add_argument("--prompts", choices=["code", "chat", "structured", "edit", "spec-bench", "agent", "all"],
                        default="all", help="all: code and chat; structured: JSON-schema answers, beside the same "
                        "prompts unconstrained (the workload's own baseline); spec-bench: Spec-Bench's questions; "
                        "agent: the first request of Codex CLI, Claude Code, Qwen Code and opencode (6-18k tokens)")
    parser.add_argument("--agents", nargs="+", choices=AGENTS, default=list(AGENTS),
                        help="with --prompts agent: whose first requests to send (default: all; each takes minutes "
                        "of prompt reading per server on a CPU core)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=MODES + OPT_IN_MODES + PEER_MODES, default=list(MODES),
                        help=f"what to run (default: %(default)s; {', '.join(OPT_IN_MODES + PEER_MODES)} only when "
                             "named)")
    parser.add_argument("--peers", action="store_true",
                        help=f"also run llama.cpp's llama-server modes: {', '.join(PEER_MODES)} (built once, cached)")
    parser.add_argument("--spec-n-max", type=int, nargs="+", default=[4, 8, 16], metavar="N",
                        help="llama-server-spec's draft lengths (--spec-draft-n-max), one variant each (default: "
                             "%(default)s)")
    parser.add_argument("--link-delay-ms", type=float, nargs="+", default=[0.0], metavar="MS",
                        help="one-way delays of the target-draft link: sync-split, duo, duo-coupled (and the baseline) "
                             "run at each, through a delay proxy (0: a direct connection)")
    parser.add_argument("--baseline-rev", default=None, metavar="REV",
                        help="also run duo as of this git revision (mode duo@REV), from a temporary worktree")
    parser.add_argument("--sync-k", type=int, default=4, help="draft length of the synchronous loop")
    parser.add_argument("--drafts", type=int, default=1, help="duo-draft processes per target (--draft-cores dealt out)")
    parser.add_argument("--cost-max-batch", type=int, default=9, help="largest batch in the verify cost curve")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1], metavar="C",
                        help="also send C requests at once, by C clients, at each level C; 1 always runs (the "
                             "speedups are against it) and the targets run with --parallel max(C) (default: 1)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out")
    add_spec_bench_arguments(parser)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return completed(build_parser().parse_args(argv))


def completed(args: argparse.Namespace) -> argparse.Namespace:
    """The flags as parsed, with the concurrency levels and the modes (--peers, --spec-n-max) spelled out."""
    args.concurrency = concurrency_levels(args.concurrency)
    modes = args.modes + [m for m in PEER_MODES if args.peers and m not in args.modes]
    args.modes = expand_modes(modes, args.spec_n_max)
    check_spec_bench_arguments(args)
    if args.prompts == "agent" and args.concurrency != [1]:
        raise SystemExit("bench: --prompts agent sends one request at a time: leave --concurrency out")
    return args


def concurrency_levels(asked: list[int]) -> list[int]:
    """The levels to run, in order, 1 among them; SystemExit for a level below 1."""
    if min(asked) < 1:
        raise SystemExit(f"bench: --concurrency levels must be >= 1, not {min(asked)}")
    return sorted({1, *asked})


def target_parallel(levels: list[int]) -> int | None:
    """duo-target's --parallel: room for the most clients at once (None, its default, for one at a time)."""
    return max(levels) if max(levels) > 1 else None


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser().parse_args(argv))


def run_bench(args: argparse.Namespace) -> int:
    """Every target's bench, with the flags as parsed (`duo bench` or scripts/bench.py)."""
    args = completed(args)
    check_modes(args.modes)
    draft = hub.resolve_model(args.draft)
    targets = [hub.resolve_model(name) for name in args.target]
    for target, out in zip(targets, out_folders(args.out, targets)):
        print(f"\n######## target {target.name}", file=sys.stderr)
        bench_target(args, target, draft, out)
    return 0


def add_agents(report: dict, runs: list[Run]) -> None:
    """The agents' table (duo.bench.agents.agent_summary) beside the summary, never in it: the summary's entries are
    temperatures, each a table of modes, and every printer and plot reads them so."""
    report["agents"] = agent_summary(runs)


def out_folders(out: Path, targets: list[Path]) -> list[Path]:
    """Where each target's bench.json goes: --out itself for one target, a folder per target for several."""
    return [out] if len(targets) == 1 else [out / target.stem for target in targets]


def measure_workload(clusters: list[Cluster | PeerServer], args: argparse.Namespace, target: Path) -> list[Run]:
    """The runs of --prompts: Spec-Bench's conversations, the agents' first requests (rendered by `target`'s
    template), or the bench's own prompts (all: code and chat)."""
    if args.prompts == "agent":
        prompts = render_with_model(read_agent_prompts(agents=args.agents), target)
        warm_up(clusters, PROMPTS["code"][0])
        return measure_agents(clusters, prompts, args.temperatures, args.reps, args.max_tokens, show_run)
    if args.prompts == "spec-bench":
        questions = pick(read_questions(args.spec_bench), args.per_group)
        warm_up(clusters, questions[0].turns[0])
        return measure_questions(clusters, questions, args.temperatures, args.reps, args.max_tokens, show_run)
    prompts = PROMPTS["code"] + PROMPTS["chat"] if args.prompts == "all" else PROMPTS[args.prompts]
    return measure(clusters, args, prompts)


def bench_target(args: argparse.Namespace, target: Path, draft: Path, out: Path) -> None:
    """Every mode on one target: costs, runs, the tables, bench.json and the charts in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)

    print(f"measuring the verify cost curve on cores {args.target_cores} ...", file=sys.stderr)
    costs = measure_verify_costs(target, set(args.target_cores), args.cost_max_batch, reps=5)
    print(f"measuring the draft's cost per token on cores {args.draft_cores} ...", file=sys.stderr)
    draft_s = measure_verify_costs(draft, set(args.draft_cores), 1, reps=9)[1]
    parallel = target_parallel(args.concurrency)
    sequence_costs = {}
    if parallel:
        print(f"measuring the cost of up to {parallel} sequences in one call ...", file=sys.stderr)
        sequence_costs = measure_sequence_costs(target, set(args.target_cores), args.concurrency, reps=5)
    baseline_mode = f"duo@{args.baseline_rev}" if args.baseline_rev else None
    baseline_commit = None
    with contextlib.ExitStack() as stack:
        codes = {}  # mode -> the code its processes run, when not this tree's
        if baseline_mode:
            codes[baseline_mode], baseline_commit = stack.enter_context(baseline_worktree(args.baseline_rev))
        variants = plan_variants(args.modes, args.link_delay_ms, baseline_mode)
        server = llama_server_binary() if any(is_peer(v.mode) for v in variants) else None
        clusters: list[Cluster | PeerServer] = []
        stack.callback(stop_all, clusters)  # before the worktree goes: callbacks run last in, first out
        cores = (set(args.target_cores), set(args.draft_cores))
        agents = args.prompts == "agent"  # one request at a time, each up to the model's whole context
        for variant in variants:
            if server and is_peer(variant.mode):
                clusters.append(start_peer(server, variant, (target, draft), cores, free_port(), parallel or 1,
                                           logs / f"{variant.label}.log", AGENT_CONTEXT if agents else CONTEXT))
            else:
                clusters.append(start_variant(variant, codes.get(variant.mode, Code.at(ROOT)), (target, draft), cores,
                                              args.sync_k, logs, 1 if agents else parallel, args.drafts))
        runs = measure_workload(clusters, args, target)

    summary = with_concurrency(summarise(runs, variants, costs, draft_s), runs, variants, costs)
    summary = with_groups(summary, runs, variants, costs, draft_s)
    machine = machine_info(args)
    report = {"machine": machine, "commit": this_commit(), "args": {k: str(v) for k, v in vars(args).items()},
              "baseline_commit": baseline_commit, "target": str(target), "draft": str(draft),
              "target_parallel": parallel, "verify_costs_s": costs, "draft_token_s": draft_s,
              "sequence_costs_s": sequence_costs,
              "summary": summary, "runs": [asdict(r) for r in runs]}
    if args.prompts == "agent":
        add_agents(report, runs)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    print(f"\ntarget {target.name}, commit {report['commit']}")
    if args.prompts == "agent":
        print(agent_table(report["agents"]))
    print_table(summary, costs, machine)
    print(f"draft: {draft_s * 1000:.1f} ms per token on cores {args.draft_cores} (for the pace-aware bound)")
    print_groups(summary)
    if parallel:
        print_concurrency(summary, sequence_costs, parallel)
    try:
        plot(summary, costs, machine, out / "bench.png")
        if parallel:
            plot_concurrency(summary, machine, out / "bench-concurrency.png")
    except ImportError:
        print("(matplotlib is not installed: no chart; pip install matplotlib)", file=sys.stderr)
    print(f"\nwrote {out / 'bench.json'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
