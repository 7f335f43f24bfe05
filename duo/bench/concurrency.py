"""The bench's concurrency numbers: C clients at once per mode, their aggregate and per-request rates, TTFT
percentiles, and the speedup over one client at a time; their table and chart.

Vocabulary: a *batch* is C requests sent together by C clients (one thread each, released at once);
its *wall time* runs from the first request sent to the last one finished. A level's *aggregate* rate
is all its batches' generated tokens over the sum of their wall times; a request's own rate is its
tokens over its own time, send to last token. *TTFT* is measured by the client, from sending the
request to receiving its first token (the connection's setup included), not the target's
time_to_first_token. The *speedup* of C clients is their aggregate over one client's, in the same mode.
The *sequence cost* S(m) is the target's time to decode one token for each of m sequences in one
call; m * S(1) / S(m) bounds the aggregate speedup of m clients of the target alone.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from duo.bench.report import Run, Variant, summarise_variant
from duo.bench.step_times import cell

# The single-client numbers a level carries too, over all its requests (bench_report's vocabulary).
CARRIED = ("verification", "token_acceptance", "mean_accepted_length", "alone_share", "branch_hit_rate",
           "waits", "wait_seconds")


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (q in [0, 1]) of `values`, interpolating linearly between neighbours (numpy's default)."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def batch_wall_times(runs: list[Run]) -> dict[int, float]:
    """Per batch: seconds from its first request sent to its last finished."""
    spans: dict[int, tuple[float, float]] = {}
    for run in runs:
        first, last = spans.get(run.batch, (math.inf, -math.inf))
        spans[run.batch] = (min(first, run.sent_s), max(last, run.sent_s + run.seconds))
    return {batch: last - first for batch, (first, last) in spans.items()}


def summarise_level(runs: list[Run], costs: dict[int, float]) -> dict:
    """The requests of one variant at one temperature and one concurrency level."""
    walls = batch_wall_times(runs)
    tokens = sum(r.tokens for r in runs)
    rates = [r.tokens_per_second for r in runs]
    ttfts = [r.ttft for r in runs]
    single = summarise_variant(runs, costs)
    return {
        "clients": runs[0].concurrency,
        "requests": len(runs),
        "batches": len(walls),
        "tokens": tokens,
        "wall_s": sum(walls.values()),
        "aggregate_tokens_per_second": tokens / sum(walls.values()),
        "per_request_tokens_per_second": {"mean": statistics.mean(rates), "min": min(rates)},
        "ttft_s": {"p50": percentile(ttfts, 0.5), "p95": percentile(ttfts, 0.95)},
        **{key: single[key] for key in CARRIED},
    }


def summarise_levels(runs: list[Run], costs: dict[int, float]) -> dict[int, dict]:
    """Each concurrency level of one variant at one temperature, by clients, with its speedup over one client."""
    levels = {c: summarise_level([r for r in runs if r.concurrency == c], costs)
              for c in sorted({r.concurrency for r in runs})}
    one = levels.get(1)
    for level in levels.values():
        level["speedup"] = level["aggregate_tokens_per_second"] / one["aggregate_tokens_per_second"] if one else None
    return levels


def with_concurrency(summary: dict[str, dict], runs: list[Run], variants: list[Variant],
                     costs: dict[int, float]) -> dict[str, dict]:
    """`summary` (bench_report.summarise's) with, where some requests ran beside others, each temperature's
    levels under "concurrency": summary[T]["concurrency"][label][clients]."""
    if all(r.concurrency == 1 for r in runs):
        return summary
    merged = {}
    for temperature, entry in summary.items():
        by_label = {}
        for variant in variants:
            mine = [r for r in runs if r.label == variant.label and str(r.temperature) == temperature]
            if mine:
                by_label[variant.label] = summarise_levels(mine, costs)
        merged[temperature] = {**entry, "concurrency": by_label}
    return merged


def speedup_line(label: str, levels: dict[int, dict]) -> str:
    """'duo: 2 clients: 1.60x, 4 clients: 2.10x the aggregate of one at a time'."""
    parts = [f"{clients} clients: {cell(level['speedup'], '.2f')}x"
             for clients, level in levels.items() if clients > 1]
    return f"{label}: {', '.join(parts)} the aggregate of one at a time"


def sequence_bounds(sequence_costs: dict[int, float]) -> dict[int, float]:
    """m * S(1) / S(m): the aggregate speedup of m clients of the target alone, were each step one call for all."""
    return {m: m * sequence_costs[1] / seconds for m, seconds in sequence_costs.items() if m > 1}


def print_concurrency(summary: dict[str, dict], sequence_costs: dict[int, float], parallel: int) -> None:
    """Per temperature, a row per variant and concurrency level, then each variant's speedups."""
    for temperature, entry in summary.items():
        if "concurrency" not in entry:
            continue
        print(f"\n== concurrency, temperature {temperature} (duo-target --parallel {parallel}: no request waits "
              f"for a turn) ==")
        print(f"{'mode':<24}{'clients':>8}{'aggregate':>10}{'speedup':>9}{'per-req mean':>13}{'min':>7}"
              f"{'ttft p50':>9}{'p95':>6}{'alpha':>7}{'tok/step':>9}")
        for label, levels in entry["concurrency"].items():
            for clients, v in levels.items():
                rates = v["per_request_tokens_per_second"]
                print(f"{label if clients == min(levels) else '':<24}{clients:>8}"
                      f"{v['aggregate_tokens_per_second']:>10.2f}{cell(v['speedup'], '.2f') + 'x':>9}"
                      f"{rates['mean']:>13.2f}{rates['min']:>7.2f}{v['ttft_s']['p50']:>9.2f}{v['ttft_s']['p95']:>6.2f}"
                      f"{cell(v['token_acceptance'], '.2f'):>7}{cell(v['mean_accepted_length'], '.2f'):>9}")
        for label, levels in entry["concurrency"].items():
            print(f"  {speedup_line(label, levels)}")
    print("\naggregate: all tokens / wall time from a batch's first request sent to its last finished (tok/s);\n"
          "per-req: each request's tokens / its own time; ttft: seconds from the client's send to its first token")
    if sequence_costs:
        s1 = sequence_costs[1]
        print("sequence cost S(m)/S(1), m sequences x 1 token in one call: "
              + "  ".join(f"{m}:{t / s1:.2f}" for m, t in sequence_costs.items()) + f"   (S(1) = {s1 * 1000:.0f} ms)")
        print("bound on the target alone's speedup, m*S(1)/S(m): "
              + "  ".join(f"{m}:{bound:.2f}x" for m, bound in sequence_bounds(sequence_costs).items()))


def plot_concurrency(summary: dict[str, dict], machine: dict, path: Path) -> None:
    """Per temperature, a line per variant: aggregate tok/s (solid) and mean per-request tok/s (dotted)
    against clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    entries = {t: e["concurrency"] for t, e in summary.items() if "concurrency" in e}
    figure, axes = plt.subplots(1, len(entries), figsize=(7 * len(entries), 5), squeeze=False)
    for ax, (temperature, by_label) in zip(axes[0], entries.items()):
        for label, levels in by_label.items():
            clients = list(levels)
            line, = ax.plot(clients, [v["aggregate_tokens_per_second"] for v in levels.values()], marker="o",
                            label=f"{label} aggregate")
            ax.plot(clients, [v["per_request_tokens_per_second"]["mean"] for v in levels.values()], linestyle=":",
                    marker=".", color=line.get_color(), label=f"{label} per request")
            for c, v in levels.items():
                if c > 1:  # its speedup over one client
                    ax.annotate(f"{cell(v['speedup'], '.2f')}x", (c, v["aggregate_tokens_per_second"]), fontsize=7,
                                textcoords="offset points", xytext=(4, 4))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c for levels in by_label.values() for c in levels}))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("clients at once")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"temperature {temperature}")
        ax.legend(fontsize=7)
    figure.suptitle(f"{machine['cpu']}, {machine['cores']} cores: aggregate against concurrency", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
