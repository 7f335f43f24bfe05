"""A pool of drafts on this box, simulated from measured costs (issue 43): 1, 2, 4, 8 clients with 1 and 2 drafts.

A 2-core box has no room for two drafts beside a target, so the pool's capacity is simulated (duo.bench.pool_sim:
the placement's own code on a simulated clock) from what is measured here, each model pinned to its core with one
thread:
  - T(n): the target's seconds for one call of n tokens, logits for each, up to 8 clients x 9 tokens; and calls
    split over 4 and 8 sequences beside T of their total, to check that a call's cost follows its tokens (the
    simulation assumes it);
  - d(m): the draft's seconds for one round drafting a token for each of m sessions (m = 1, 2, 4, 8): the call
    duo.bench.timing.measure_sequence_costs times, the fastest of the reps kept as for T(n);
  - acceptance: read from the Spec-Bench and code runs measured on this box (scripts/bench-results/epyc-*.json).
Beside the simulated pools, "drafts never late" is the ceiling of any number of drafts without branches: every
session's k drafts there at every call.
Then it sets the simulation at one draft beside what was measured for real: the concurrency runs of a 2-core Xeon
(each from its own T(n), measured up to 9 tokens and extrapolated beyond, and its own acceptance) and the
one-client runs of this box. Everything goes to --out.

    .venv/bin/python scripts/simulate_pool.py              # measures for about 3.5 minutes
    .venv/bin/python scripts/simulate_pool.py --costs scripts/bench-results/pool-sim-epyc.json   # no measuring
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from duo.bench.machine import cpu_model
from duo.bench.pace_bound import batch_cost
from duo.bench.pool_sim import KS, DraftSpec, Outcome, alone, best_k
from duo.bench.run import this_commit
from duo.bench.timing import COST_PREFIX, batch_tokens, pinned
from duo.llama.model import Model
from duo.llama.context import Context, Part

RESULTS = Path(__file__).resolve().parent / "bench-results"
MODELS = Path.home() / ".cache" / "duo" / "models"
CLIENTS = (1, 2, 4, 8)
ROUND_SIZES = [1, 2, 4, 8]
# Every size a call of up to 4 clients can have, then every 4th: a CPU's matrix kernels make T(n) step, not grow
# smoothly (on this EPYC T(9) < T(8)), so sizes between measured ones are interpolated only where calls are rarer.
CALL_SIZES = [*range(1, 49), *range(52, 73, 4)]
SPLIT_CALLS = [(4, 3), (4, 5), (8, 3), (8, 9)]  # (sequences, tokens each): verify calls of 4 and 8 clients
GPU_SPEEDUP = 4.0                 # an assumption, not a measurement: a GPU draft's d(m) = the CPU draft's / 4
ACCEPTANCE_FROM = {"spec-bench": "epyc-specbench-f16.json", "code": "epyc-code-f16.json"}
# The concurrency runs measured for real with one draft (a 2-core Xeon), and one client on this box.
REAL_RUNS = ["concurrency-f16.json", "xeon-concurrency-f16.json", "xeon-concurrency-f16-128.json"]
REAL_SINGLE = ["epyc-specbench-f16.json", "epyc-code-f16.json"]
COST_KEYS = ("verify_costs_s", "split_call_costs_s", "draft_round_costs_s", "timing", "measured_in_s")


# Measuring.
def measure_calls(path: Path, core: int, shapes: list[tuple[int, int]], reps: int) -> dict[tuple, list[float]]:
    """Each rep's seconds of one call of `tokens` tokens (logits for each) in each of `sequences` sequences after a
    200-token prefix, the sequences forked from one (duo.bench.timing's way). The shapes take turns rep after rep,
    so that a busy spell of the box hits them alike."""
    with pinned({core}):
        model = Model(path, device="cpu", threads=1)
        sequences = max(s for s, _ in shapes)
        context = model.new_context(1024, n_seq=sequences)
        prefix = model.tokenize(COST_PREFIX)[:200]
        context.decode(prefix, 0, logits_for=[])
        for seq in range(1, sequences):
            context.fork(seq, len(prefix))
        times: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
        for _ in range(reps):
            for sequences, tokens in shapes:
                batch = batch_tokens(model, tokens)
                parts = [Part(seq, len(prefix), batch, range(tokens)) for seq in range(sequences)]
                times[(sequences, tokens)].append(_timed(context, parts, len(prefix)))
        context.close()
        model.close()
        return times


def _timed(context: Context, parts: list[Part], prefix: int) -> float:
    began = time.perf_counter()
    context.decode_parts(parts)
    seconds = time.perf_counter() - began
    for part in parts:
        context.rollback(prefix, part.seq)
    return seconds


def measure(args: argparse.Namespace) -> dict:
    """T(n) and the split calls on the target's core, the draft's d(m) on the draft's."""
    began = time.monotonic()
    target = measure_calls(args.target, args.target_core, [(1, n) for n in CALL_SIZES] + SPLIT_CALLS, args.reps)
    draft = measure_calls(args.draft, args.draft_core, [(m, 1) for m in ROUND_SIZES], args.reps)
    everything = [*target.values(), *draft.values()]
    spread = statistics.median(statistics.median(times) / min(times) for times in everything)
    return {"verify_costs_s": {n: min(target[(1, n)]) for n in CALL_SIZES},  # others' processes only add time
            "split_call_costs_s": {f"{s}x{t}": min(target[(s, t)]) for s, t in SPLIT_CALLS},
            "draft_round_costs_s": {m: min(draft[(m, 1)]) for m in ROUND_SIZES},
            "timing": f"the fastest of {args.reps} reps per size; the median rep was {spread:.2f}x the fastest "
                      "(median over sizes)",
            "measured_in_s": time.monotonic() - began}


def by_int(table: dict) -> dict[int, float]:
    return {int(k): float(v) for k, v in table.items()}


def read_costs(path: Path) -> dict:
    """Costs measured before, with where and when: this script's JSON, or a bench.json's T(n) (its draft's d(m)
    is then m d(1), the conservative side: it timed its draft at one session only)."""
    data = json.loads(path.read_text())
    source = {"costs_from": {"file": str(path), "machine": data.get("machine"), "commit": data.get("commit")}}
    if "draft_round_costs_s" in data:
        return {**{key: data[key] for key in COST_KEYS if key in data}, **source}
    d1 = float(data["draft_token_s"])
    print(f"{path}: no draft round costs: d(m) = m x d(1)")
    return {"verify_costs_s": data["verify_costs_s"], "draft_round_costs_s": {m: m * d1 for m in ROUND_SIZES}, **source}


def acceptance(name: str) -> float:
    data = json.loads((RESULTS / name).read_text())
    return data["summary"]["0.0"]["modes"]["duo"]["token_acceptance"]


def print_split_calls(split: dict[str, float], costs: dict[int, float]) -> None:
    """Whether a call's cost follows its tokens however they split into sequences (the simulation assumes it)."""
    for shape, seconds in split.items():
        sequences, tokens = map(int, shape.split("x"))
        total = sequences * tokens
        print(f"a call of {sequences} sequences x {tokens} tokens: {seconds:.3f} s;"
              f" T({total}) {batch_cost(costs, total):.3f} s")


# Simulating.
def pools(rounds: dict[int, float], a: float) -> dict[str, list[DraftSpec]]:
    cpu = DraftSpec("cpu", rounds, a)
    gpu = DraftSpec("gpu", {m: s / GPU_SPEEDUP for m, s in rounds.items()}, a)
    return {"1 draft": [cpu], "2 drafts": [cpu, DraftSpec("cpu2", rounds, a)], "cpu+gpu drafts": [cpu, gpu]}


def row(clients: int, label: str, outcome: Outcome, base: Outcome) -> dict:
    return {"clients": clients, "drafts": label, "k": outcome.k,
            "tokens_per_second": outcome.tokens_per_second,
            "per_client_tokens_per_second": outcome.per_client_tokens_per_second,
            "x_alone": outcome.tokens_per_second / base.tokens_per_second,
            "tokens_per_session_step": outcome.tokens_per_session_step, "starved_share": outcome.starved_share,
            "mean_sessions": outcome.mean_sessions, "draft_busy": outcome.busy, "moves": outcome.moves}


def ceiling(clients: int, costs: dict[int, float], a: float, base: Outcome) -> dict:
    """Every session's k drafts there at every call, whatever the drafts (no branch): N E(k) / T(N (k + 1))."""
    def rate(k: int) -> float:
        return clients * sum(a ** i for i in range(k + 1)) / batch_cost(costs, clients * (k + 1))

    k = max(KS, key=rate)
    return {"clients": clients, "drafts": "drafts never late", "k": k, "tokens_per_second": rate(k),
            "per_client_tokens_per_second": rate(k) / clients, "x_alone": rate(k) / base.tokens_per_second,
            "tokens_per_session_step": sum(a ** i for i in range(k + 1)), "starved_share": 0.0,
            "mean_sessions": {}, "draft_busy": {}, "moves": 0}


def capacity(costs: dict[int, float], rounds: dict[int, float], a: float, tokens: int, seeds: int) -> list[dict]:
    rows = []
    for clients in CLIENTS:
        base = alone(clients, tokens, costs)
        rows.append(row(clients, "alone", base, base))
        for label, drafts in pools(rounds, a).items():
            rows.append(row(clients, label, best_k(clients, tokens, costs, drafts, seeds=seeds), base))
        rows.append(ceiling(clients, costs, a, base))
    return rows


def print_capacity(title: str, rows: list[dict]) -> None:
    print(f"\n{title}\n{'clients':>7} {'drafts':>17} {'k':>2} {'tok/s':>7} {'per client':>10} {'x alone':>7}"
          f" {'tok/step':>8} {'starved':>7}  per draft: sessions, busy")
    for r in rows:
        drafts = ", ".join(f"{name} {n:.1f} {r['draft_busy'][name]:.0%}" for name, n in r["mean_sessions"].items())
        print(f"{r['clients']:>7} {r['drafts']:>17} {r['k']:>2} {r['tokens_per_second']:>7.2f}"
              f" {r['per_client_tokens_per_second']:>10.2f} {r['x_alone']:>6.2f}x"
              f" {r['tokens_per_session_step']:>8.2f} {r['starved_share']:>7.0%}  {drafts}")


# Checking against what was measured for real.
def real_levels(data: dict) -> dict[int, tuple[dict, dict]]:
    """Per level of clients: the real (alone, duo) summaries."""
    levels = data["summary"]["0.0"].get("concurrency") or {}
    if levels:
        return {int(n): (levels["alone-tcores"][n], levels["duo"][n]) for n in levels["duo"]}
    modes = data["summary"]["0.0"]["modes"]  # one client: its rates with and without the prompts' reading

    def level(mode: dict) -> dict:
        return {**mode, "aggregate_tokens_per_second": mode["tokens_per_second"]}

    return {1: (level(modes["alone-tcores"]), level(modes["duo"]))}


def check(name: str, costs: dict[int, float], rounds: dict[int, float], seeds: int) -> list[dict]:
    """The simulation at one draft beside a real run's levels, each from that run's own T(n) and acceptance."""
    data = json.loads((RESULTS / name).read_text())
    tokens = int(data["args"]["max_tokens"])
    rows = []
    for clients, (real_alone, real_duo) in sorted(real_levels(data).items()):
        a = real_duo["token_acceptance"]
        base = alone(clients, tokens, costs)
        sim = best_k(clients, tokens, costs, [DraftSpec("draft", rounds, a)], seeds=seeds)
        real_x = real_duo["aggregate_tokens_per_second"] / real_alone["aggregate_tokens_per_second"]
        decode_x = (real_duo["decode_tokens_per_second"] / real_alone["decode_tokens_per_second"]
                    if "decode_tokens_per_second" in real_duo else None)
        rows.append({"run": name, "cpu": data["machine"]["cpu"], "tokens": tokens, "clients": clients,
                     "acceptance": a, "real_alone": real_alone["aggregate_tokens_per_second"],
                     "real_duo": real_duo["aggregate_tokens_per_second"], "real_x": real_x,
                     "real_x_decoding": decode_x,
                     "real_alone_share": real_duo.get("alone_share"),
                     "sim_alone": base.tokens_per_second, "sim_duo": sim.tokens_per_second, "sim_k": sim.k,
                     "sim_x": sim.tokens_per_second / base.tokens_per_second, "sim_starved": sim.starved_share})
    return rows


def real_run_rounds(data: dict) -> dict[int, float]:
    """A real run's draft d(m): its d(1), scaled by S(m) / S(1), the same run's target on the same CPU. An
    assumption: those runs timed their draft at one session only (the README's ~150 ms for two rounds at four
    sessions on that Xeon agrees: d(4) / d(1) about 1.2, S(4) / S(1) 1.14-1.23)."""
    d1, shape = float(data["draft_token_s"]), by_int(data["sequence_costs_s"])
    return {m: d1 * shape[m] / shape[1] for m in shape}


def validate(measured: dict, seeds: int) -> list[dict]:
    rows = []
    for name in REAL_RUNS:
        data = json.loads((RESULTS / name).read_text())
        rows += check(name, by_int(data["verify_costs_s"]), real_run_rounds(data), seeds)
    for name in REAL_SINGLE:  # this box: the costs measured now
        rows += check(name, by_int(measured["verify_costs_s"]), by_int(measured["draft_round_costs_s"]), seeds)
    return rows


def print_validation(rows: list[dict]) -> None:
    print("\nOne draft, simulated vs measured for real. real: aggregate tok/s, prompts read included (x decoding:"
          " without them, one client only); sim: decoding only. Steps alone: session-steps without drafts.")
    print(f"{'run':>30} {'N':>2} {'a':>5} {'real alone':>10} {'real duo':>8} {'real x':>6} {'x decoding':>10}"
          f" {'steps alone':>11} {'sim alone':>9} {'sim duo':>7} {'sim x':>6} {'steps alone':>11}")
    for r in rows:
        share = f"{r['real_alone_share']:.0%}" if r["real_alone_share"] is not None else "-"
        decoding = f"{r['real_x_decoding']:.2f}x" if r["real_x_decoding"] is not None else "-"
        print(f"{r['run']:>30} {r['clients']:>2} {r['acceptance']:>5.3f} {r['real_alone']:>10.2f}"
              f" {r['real_duo']:>8.2f} {r['real_x']:>5.2f}x {decoding:>10} {share:>11} {r['sim_alone']:>9.2f}"
              f" {r['sim_duo']:>7.2f} {r['sim_x']:>5.2f}x {r['sim_starved']:>11.0%}")
    for clients in sorted({r["clients"] for r in rows}):
        gaps = [r["sim_x"] / r["real_x"] for r in rows if r["clients"] == clients]
        print(f"{clients} client(s): the simulated gain over alone is {min(gaps):.2f}-{max(gaps):.2f}x the real one")


def machine(args: argparse.Namespace) -> dict:
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "avx512": "avx512f" in flags.split(),
            "target_core": args.target_core, "draft_core": args.draft_core}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=MODELS / "qwen2.5-coder-1.5b-instruct-f16.gguf")
    parser.add_argument("--draft", type=Path, default=MODELS / "qwen2.5-coder-0.5b-instruct-q4_0.gguf")
    parser.add_argument("--target-core", type=int, default=1)
    parser.add_argument("--draft-core", type=int, default=0)
    parser.add_argument("--reps", type=int, default=5, help="timings per size (the fastest is kept)")
    parser.add_argument("--costs", type=Path, help="read the costs from this JSON instead of measuring")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each simulated session generates")
    parser.add_argument("--seeds", type=int, default=16, help="simulated runs per point and k")
    parser.add_argument("--out", type=Path, default=RESULTS / "pool-sim-epyc.json")
    args = parser.parse_args()

    measured = read_costs(args.costs) if args.costs else measure(args)
    costs, rounds = by_int(measured["verify_costs_s"]), by_int(measured["draft_round_costs_s"])
    print("T(n) s:", {n: round(s, 4) for n, s in costs.items()})
    print("draft d(m) s:", {m: round(s, 4) for m, s in rounds.items()})
    print_split_calls(measured.get("split_call_costs_s", {}), costs)
    accepted = {name: acceptance(file) for name, file in ACCEPTANCE_FROM.items()}
    tables = {}
    for name, a in accepted.items():
        tables[name] = capacity(costs, rounds, a, args.tokens, args.seeds)
        print_capacity(f"{name}: acceptance {a:.3f}, {args.tokens} tokens a client", tables[name])
    checks = validate(measured, args.seeds)
    print_validation(checks)
    report = {"machine": machine(args), "commit": this_commit(), "target": str(args.target),
              "draft": str(args.draft), "tokens": args.tokens, "seeds": args.seeds, **measured,
              "acceptance": accepted, "gpu_draft_assumption": f"d(m) of the CPU draft / {GPU_SPEEDUP:g}",
              "simulation": "duo.bench.pool_sim: fixed k (the best of 1..8 per point), the target never waits for"
                            " drafts; no branches, lookup, switch or prompt reading; each draft on cores of its own;"
                            " links 1 ms one way",
              "capacity": tables, "validation": checks}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
