"""Benchmark duo against its peers side by side, in one run: the target alone, synchronous speculation, duo.

Modes, alternated within each repetition so that machine noise hits all of them alike:
  alone-tcores   duo-target without a draft, on the target's cores            (a)
  alone-all      duo-target without a draft, on all cores                     (a)
  sync-split     llama.cpp's classic loop (draft K, verify), draft and target
                 on their own cores, taking turns                             (b)
  sync-shared    the same loop, both models using all cores                   (b')
  duo            duo-draft and duo-target, each pinned to its own cores       (c)
It also measures the target's verify cost curve T(n) (a batch of n tokens) on the target's cores and
computes the ideal speedup bound max_k E[tokens per verify](k) / T(k+1) from duo's measured
acceptance, and duo's fraction of it. Writes bench.json and bench.png to --out, prints a table.

Example (2 cores: draft on core 0, target on core 1; F16 target = the memory-bound case):
  python scripts/bench.py --target qwen2.5-coder-1.5b-instruct-f16 --draft qwen2.5-coder-0.5b-instruct \
      --draft-cores 0 --target-cores 1 --prompts code --temperatures 0 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from duo import hub  # noqa: E402
from duo._proto import duo_pb2 as pb  # noqa: E402
from duo._proto import duo_pb2_grpc as pb_grpc  # noqa: E402
from duo.demo import free_port, spawn  # noqa: E402

PROMPTS = {
    # As in the community tests of llama-server's speculative decoding.
    "code": ["Write a snake game in Python.", "Write a snake game in TypeScript.", "Write a snake game in Swift."],
    "chat": ["Explain, in a few paragraphs, why the sky is blue and why sunsets are red.",
             "Describe the history of the printing press and its effect on Europe."],
}
MODES = ("alone-tcores", "alone-all", "sync-split", "sync-shared", "duo")


@dataclass
class Run:
    mode: str
    prompt: str
    temperature: float
    rep: int
    tokens: int
    seconds: float
    ttft: float
    verify_steps: int
    draft_received: int
    draft_verified: int
    draft_accepted: int
    draft_rejections: int
    batch_sizes: list[int]  # [n]: verify steps that decoded n tokens

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first token: what speculation changes."""
        return (self.tokens - 1) / max(self.seconds - self.ttft, 1e-9)


@dataclass
class Cluster:
    """The processes of one mode; `address` is its target's client endpoint."""

    mode: str
    address: str
    processes: list[subprocess.Popen] = field(default_factory=list)
    speculative: bool = False


def start_mode(mode: str, args: argparse.Namespace, target: Path, draft: Path, logs: Path) -> Cluster:
    all_cores = set(os.sched_getaffinity(0))
    target_cores, draft_cores = set(args.target_cores), set(args.draft_cores)
    address = f"127.0.0.1:{free_port()}"
    target_args = ["--model", str(target), "--listen", address, "--device", "cpu", "--log-level", "WARNING"]
    if mode.startswith("alone"):
        cores = target_cores if mode == "alone-tcores" else all_cores
        return Cluster(mode, address, [spawn("duo.target_process", target_args, cores, logs / f"{mode}.log")])
    shared = mode == "sync-shared"
    peer = f"127.0.0.1:{free_port()}"
    draft_process = spawn("duo.draft_process", ["--model", str(draft), "--listen", peer, "--device", "cpu",
                                        "--log-level", "WARNING"],
                          all_cores if shared else draft_cores, logs / f"{mode}-draft.log")
    extra = ["--sync", str(args.sync_k)] if mode.startswith("sync") else []
    target_process = spawn("duo.target_process", [*target_args, "--peer", peer, *extra],
                           all_cores if shared else target_cores, logs / f"{mode}-target.log")
    return Cluster(mode, address, [draft_process, target_process], speculative=True)


def generate(address: str, prompt: str, temperature: float, max_tokens: int, seed: int) -> tuple[pb.GenerateResponse, float, float]:
    """One chat generation; (last message, seconds, time to first token) measured by the client."""
    request = pb.GenerateRequest(max_tokens=max_tokens, sampling=pb.SamplingParams(temperature=temperature, seed=seed))
    request.messages.append(pb.ChatMessage(role="user", content=prompt))
    started = time.perf_counter()
    first = None
    last = pb.GenerateResponse()
    with grpc.insecure_channel(address) as channel:
        for last in pb_grpc.TargetStub(channel).Generate(request, wait_for_ready=True, timeout=3600):
            if first is None and last.token_ids:
                first = time.perf_counter() - started
    return last, time.perf_counter() - started, first or 0.0


def wait_ready(cluster: Cluster, timeout: float = 300) -> None:
    """Until the target answers and, for speculative modes, its draft is connected."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in cluster.processes):
            raise SystemExit(f"{cluster.mode}: a process exited; see its log")
        try:
            last, _, _ = generate(cluster.address, "hi", 0.0, 2, 0)
            if last.stats.draft_connected or not cluster.speculative:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{cluster.mode}: not ready after {timeout}s")


def measure_verify_costs(target: Path, cores: set[int], max_batch: int, reps: int) -> dict[int, float]:
    """T(n): median seconds to decode a batch of n tokens after a 200-token prefix, on `cores`."""
    from duo.model import Model

    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        model = Model(target, device="cpu", threads=len(cores))
        context = model.new_context(1024)
        prefix = model.tokenize("def snake_game():\n" + "    x = step(x)\n" * 40)[:200]
        context.decode(prefix, 0, logits_for=[])
        batch = model.tokenize(" score = score + 1 if food == head else score")[:max_batch]
        costs = {}
        for n in range(1, max_batch + 1):
            times = []
            for _ in range(reps):
                began = time.perf_counter()
                context.decode(batch[:n], len(prefix), logits_for=range(n))
                times.append(time.perf_counter() - began)
                context.rollback(len(prefix))
            costs[n] = statistics.median(times)
        context.close()
        model.close()
        return costs
    finally:
        os.sched_setaffinity(0, saved)


def ideal_rate(acceptance: float, costs: dict[int, float]) -> tuple[float, int]:
    """max over k of E[tokens per verify](k) / T(k + 1), with i.i.d. acceptance: E(k) = sum_{i<=k} a^i.

    This assumes the draft always has k tokens ready the moment the target needs them: the bound
    for any speculative scheme with this draft, this target and this device."""
    best, best_k = 0.0, 0
    for n, seconds in costs.items():
        k = n - 1
        expected = sum(acceptance ** i for i in range(k + 1))
        if expected / seconds > best:
            best, best_k = expected / seconds, k
    return best, best_k


def batch_histogram(runs: list[Run]) -> dict[int, int]:
    """How many verify steps decoded n tokens at once, over `runs`."""
    total: dict[int, int] = {}
    for run in runs:
        for n, count in enumerate(run.batch_sizes):
            if count:
                total[n] = total.get(n, 0) + count
    return dict(sorted(total.items()))


def summarise(runs: list[Run], costs: dict[int, float]) -> dict:
    """Per mode and temperature: totals, rates, acceptance; duo's ratios and fraction of the ideal."""
    summary: dict = {}
    for temperature in sorted({r.temperature for r in runs}):
        by_mode = {}
        for mode in MODES:
            rs = [r for r in runs if r.mode == mode and r.temperature == temperature]
            if not rs:
                continue
            tokens, seconds = sum(r.tokens for r in rs), sum(r.seconds for r in rs)
            verified, accepted = sum(r.draft_verified for r in rs), sum(r.draft_accepted for r in rs)
            rejections = sum(r.draft_rejections for r in rs)
            steps = sum(r.verify_steps for r in rs)
            by_mode[mode] = {
                "tokens_per_second": tokens / seconds,
                "decode_tokens_per_second": sum(r.tokens - 1 for r in rs) / sum(r.seconds - r.ttft for r in rs),
                "acceptance_rate": accepted / verified if verified else None,
                # Verification stops at the first rejection: this is the per-token chance.
                "token_acceptance": accepted / (accepted + rejections) if accepted + rejections else None,
                "mean_accepted_length": tokens / steps if steps else None,
                "mean_draft_tokens_per_verify": verified / steps if steps else None,
                "ttft_s": statistics.mean(r.ttft for r in rs),
                "verify_batch_sizes": batch_histogram(rs),
                "per_prompt": {p: statistics.mean(r.tokens_per_second for r in rs if r.prompt == p)
                               for p in dict.fromkeys(r.prompt for r in rs)},
            }
        duo = by_mode.get("duo")
        entry: dict = {"modes": by_mode}
        if duo:
            entry["ratios"] = {f"duo/{m}": duo["tokens_per_second"] / v["tokens_per_second"]
                               for m, v in by_mode.items() if m != "duo"}
            if duo["token_acceptance"] is not None and costs:
                rate, k = ideal_rate(duo["token_acceptance"], costs)
                entry["ideal"] = {"tokens_per_second": rate, "best_k": k,
                                  "duo_fraction": duo["decode_tokens_per_second"] / rate}
        summary[str(temperature)] = entry
    return summary


def machine_info() -> dict:
    from duo.model import available_backends

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    import llama_cpp

    return {"cpu": cpu, "cores": os.cpu_count(), "backends": available_backends(),
            "llama_cpp_python": llama_cpp.__version__, "python": platform.python_version()}


def print_table(summary: dict, costs: dict[int, float]) -> None:
    for temperature, entry in summary.items():
        print(f"\n== temperature {temperature} ==")
        print(f"{'mode':<14}{'tok/s':>8}{'decode':>8}{'accept':>8}{'alpha':>7}{'len':>6}{'ttft':>7}   per prompt tok/s")
        for mode, v in entry["modes"].items():
            acc = f"{v['acceptance_rate']:.2f}" if v["acceptance_rate"] is not None else "-"
            alpha = f"{v['token_acceptance']:.2f}" if v["token_acceptance"] is not None else "-"
            length = f"{v['mean_accepted_length']:.2f}" if v["mean_accepted_length"] else "-"
            prompts = "  ".join(f"{t:.2f}" for t in v["per_prompt"].values())
            print(f"{mode:<14}{v['tokens_per_second']:>8.2f}{v['decode_tokens_per_second']:>8.2f}{acc:>8}"
                  f"{alpha:>7}{length:>6}{v['ttft_s']:>7.2f}   {prompts}")
            if v["mean_draft_tokens_per_verify"]:
                sizes = " ".join(f"{n}:{c}" for n, c in v["verify_batch_sizes"].items())
                print(f"{'':<14}verify batch sizes (tokens:steps) {sizes}")
        for name, ratio in entry.get("ratios", {}).items():
            print(f"  {name:<20} {ratio:.2f}x")
        if "ideal" in entry:
            ideal = entry["ideal"]
            print(f"  ideal bound {ideal['tokens_per_second']:.2f} tok/s (k={ideal['best_k']}); "
                  f"duo reaches {ideal['duo_fraction']:.0%} of it")
    if costs:
        t1 = costs[1]
        print("\nverify cost T(n)/T(1): " + "  ".join(f"{n}:{t / t1:.2f}" for n, t in costs.items())
              + f"   (T(1) = {t1 * 1000:.0f} ms)")


def plot(summary: dict, costs: dict[int, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(summary) + 1, figsize=(6 * (len(summary) + 1), 4.5))
    for ax, (temperature, entry) in zip(axes, summary.items()):
        modes = list(entry["modes"])
        prompts = list(next(iter(entry["modes"].values()))["per_prompt"])
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            values = [entry["modes"][mode]["per_prompt"].get(p, 0) for p in prompts]
            ax.bar([j + i * width for j in range(len(prompts))], values, width, label=mode)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(prompts))])
        ax.set_xticklabels([p[:24] for p in prompts], rotation=15, fontsize=8)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"temperature {temperature}")
        ax.legend(fontsize=8)
    ax = axes[-1]
    if costs:
        ns = list(costs)
        ax.plot(ns, [costs[n] / costs[1] for n in ns], marker="o", label="measured T(n)/T(1)")
        ax.plot(ns, ns, linestyle="--", label="n single steps")
    ax.set_xlabel("tokens in one verify batch (n)")
    ax.set_ylabel("cost relative to one step")
    ax.set_title("target verify cost")
    ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=hub.DEFAULT_TARGET, help="target model: name or path")
    parser.add_argument("--draft", default=hub.DEFAULT_DRAFT, help="draft model: name or path")
    parser.add_argument("--target-cores", type=int, nargs="+", default=[1])
    parser.add_argument("--draft-cores", type=int, nargs="+", default=[0])
    parser.add_argument("--prompts", choices=["code", "chat", "all"], default="all")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--sync-k", type=int, default=4, help="draft length of the synchronous loop")
    parser.add_argument("--cost-max-batch", type=int, default=9, help="largest batch in the verify cost curve")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out")
    args = parser.parse_args()

    target, draft = hub.resolve_model(args.target), hub.resolve_model(args.draft)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    prompts = PROMPTS["code"] + PROMPTS["chat"] if args.prompts == "all" else PROMPTS[args.prompts]

    print(f"measuring the verify cost curve on cores {args.target_cores} ...", file=sys.stderr)
    costs = measure_verify_costs(target, set(args.target_cores), args.cost_max_batch, reps=5)
    clusters = [start_mode(mode, args, target, draft, logs) for mode in args.modes]
    runs: list[Run] = []
    try:
        for cluster in clusters:
            wait_ready(cluster)
            generate(cluster.address, prompts[0], 0.0, 16, 0)  # warm caches
        for rep in range(args.reps):
            for temperature in args.temperatures:
                for prompt in prompts:
                    for cluster in clusters:
                        last, seconds, ttft = generate(cluster.address, prompt, temperature, args.max_tokens, seed=rep)
                        s = last.stats
                        run = Run(cluster.mode, prompt, temperature, rep, s.generated_tokens, seconds, ttft,
                                  s.verify_steps, s.draft_tokens_received, s.draft_tokens_verified,
                                  s.draft_tokens_accepted, s.draft_rejections, list(s.batch_sizes))
                        runs.append(run)
                        print(f"rep {rep} T={temperature} {cluster.mode:<13} {run.tokens_per_second:6.2f} tok/s "
                              f"({run.tokens} tokens, accepted {run.draft_accepted}/{run.draft_verified}) "
                              f"{prompt[:40]}", file=sys.stderr)
    finally:
        for cluster in clusters:
            for process in cluster.processes:
                process.terminate()
            for process in cluster.processes:
                process.wait(30)

    summary = summarise(runs, costs)
    report = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
              "target": str(target), "draft": str(draft), "verify_costs_s": costs, "summary": summary,
              "runs": [asdict(r) for r in runs]}
    (args.out / "bench.json").write_text(json.dumps(report, indent=2))
    print_table(summary, costs)
    try:
        plot(summary, costs, args.out / "bench.png")
    except ImportError:
        print("(matplotlib is not installed: no chart; pip install matplotlib)", file=sys.stderr)
    print(f"\nwrote {args.out / 'bench.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
