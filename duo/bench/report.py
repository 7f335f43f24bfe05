"""The bench's numbers: one Run per generation, summaries per temperature and variant, the table and the chart.

Vocabulary (as vLLM's): a *verify step* is one target decode, of the chain tokens it holds plus one;
*acceptance* is per draft token: accepted / (accepted + rejections), since verification stops at
the first rejection; *tokens per step* counts every committed token, the bonus or corrected one
included; a step *decoded alone* had no draft token to verify (a batch of 1).
*verification* is how the target checked sampled drafts (Stats.verification): "residual" (rejection
sampling against the draft's q), "coupled" (shared Gumbel noise) or "greedy"; duo runs residual,
duo-coupled coupled, and per temperature the two are compared at each link delay.
The *rpc split* compares alone-rpc (the target's layers on two local RPC servers) with alone-tcores
(the same cores, no RPC): their tok/s ratio and the milliseconds the split adds to each token.
The *step times* say where a target's decode time went, step by step (duo.bench.step_times).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from duo.bench.pace_bound import pace_bound
from duo.bench.step_times import LEGEND, PARTS, cell, step_table, summarise_step_times

# Modes whose target talks to a draft over the link: these run once per --link-delay-ms.
# sync-shared puts both models on the same cores, one machine: it runs with a direct link only.
# alone-rpc splits the target's layers over two RPC servers on its own machine: no link either.
UNDELAYED_MODES = ("alone-tcores", "alone-all", "sync-shared", "alone-rpc", "lookup-tcores")
# The same duo, its sampled requests verified by coupled sampling rather than residual rejection sampling.
COUPLED_MODE, RESIDUAL_MODE = "duo-coupled", "duo"
# The target split over RPC servers, and the same target on the same cores without them.
RPC_MODE, LOCAL_MODE = "alone-rpc", "alone-tcores"
# llama.cpp's own server alone on the target's cores: what every variant is also compared with.
PEER_BASE = "llama-server"


@dataclass(frozen=True)
class Variant:
    """A mode run at one link delay (one way, ms; 0: a direct connection)."""

    mode: str
    link_delay_ms: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.mode} +{self.link_delay_ms:g}ms" if self.link_delay_ms else self.mode


@dataclass
class Run:
    """One generation, with the target's Stats at its end."""

    mode: str
    link_delay_ms: float
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
    branch_hits: int  # rejections whose next step found a branch ready for the corrected token
    waits: int  # steps where the target waited for the draft instead of decoding alone
    wait_seconds: float
    verification: str = ""  # "greedy", "coupled" or "residual"; "" from revisions before coupled sampling
    seed: int = 0  # the sampled request's seed (the target draws it: the bench sends none)
    concurrency: int = 1  # requests of its batch, sent together by as many clients
    batch: int = 0  # which batch: runs of one batch ran at the same time
    sent_s: float = 0.0  # when its client sent it, seconds after its batch's first request was sent
    draft_cpu_s: float | None = None  # CPU seconds its duo-draft spent during its batch (None: no such process)
    category: str = ""  # Spec-Bench's category of its question (duo.bench.specbench); "" for the bench's own prompts
    question_id: int = 0  # Spec-Bench's question_id
    turn: int = 0  # which turn of its question's conversation (1, 2), 0 outside Spec-Bench
    prompt_tokens: int = 0  # the prompt's tokens as its server counted them (--prompts agent; 0 elsewhere)
    # Where its decode time went, as its target counted it (duo.bench.step_times.PARTS: seconds; empty for a server
    # that does not say), and the commits that left it without drafts with the seconds until the next chain came.
    step_seconds: dict[str, float] = field(default_factory=dict)
    round_trips: int = 0
    round_trip_s: float = 0.0

    @property
    def label(self) -> str:
        return Variant(self.mode, self.link_delay_ms).label

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def run_from_stats(variant: Variant, prompt: str, temperature: float, rep: int, stats: Any,
                   seconds: float, ttft: float, *, concurrency: int = 1, batch: int = 0, sent_s: float = 0.0) -> Run:
    """A Run from a Generate's final Stats. Fields a target's revision lacks (branch_hits, waits,
    wait_seconds came with issue 10; verification and seed with coupled sampling) read as 0 or "",
    so the bench measures older revisions too (the step times came with issue 52). `concurrency`, `batch`,
    `sent_s`: see Run."""
    run = Run(variant.mode, variant.link_delay_ms, prompt, temperature, rep, stats.generated_tokens,
              seconds, ttft, stats.verify_steps, stats.draft_tokens_received, stats.draft_tokens_verified,
              stats.draft_tokens_accepted, stats.draft_rejections, list(stats.batch_sizes),
              getattr(stats, "branch_hits", 0), getattr(stats, "waits", 0), getattr(stats, "wait_seconds", 0.0),
              getattr(stats, "verification", ""), getattr(stats, "seed", 0), concurrency, batch, sent_s)
    run.step_seconds = {part: getattr(stats, f"step_{part}_seconds", 0.0) for part in PARTS}
    run.round_trips = getattr(stats, "commit_round_trips", 0)
    run.round_trip_s = getattr(stats, "commit_round_trip_seconds", 0.0)
    return run


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


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def summarise_variant(runs: list[Run], costs: dict[int, float], draft_s: float | None = None) -> dict:
    """Totals and rates over the runs of one variant at one temperature; `draft_s`: the draft's measured
    seconds per token, for the pace-aware bound."""
    tokens, steps = sum(r.tokens for r in runs), sum(r.verify_steps for r in runs)
    verified, accepted = sum(r.draft_verified for r in runs), sum(r.draft_accepted for r in runs)
    rejections = sum(r.draft_rejections for r in runs)
    histogram = batch_histogram(runs)
    entry = {
        "mode": runs[0].mode,
        "link_delay_ms": runs[0].link_delay_ms,
        # As the target reported it; several joined by "/" (not expected), None when it reported none.
        "verification": "/".join(sorted({r.verification for r in runs if r.verification})) or None,
        "tokens_per_second": tokens / sum(r.seconds for r in runs),
        "decode_tokens_per_second": sum(r.tokens - 1 for r in runs) / sum(r.seconds - r.ttft for r in runs),
        "acceptance_rate": _ratio(accepted, verified),
        # llama-server reports no rejections (nor verify steps): its acceptance is accepted / drafted only.
        "token_acceptance": None if is_llama_server(runs[0].mode) else _ratio(accepted, accepted + rejections),
        # Tokens committed per verify step (mean accepted length, the bonus token included).
        "mean_accepted_length": _ratio(tokens, steps),
        "mean_draft_tokens_per_verify": _ratio(verified, steps),
        "alone_share": _ratio(histogram.get(1, 0), steps),
        "branch_hit_rate": _ratio(sum(r.branch_hits for r in runs), rejections),
        "waits": sum(r.waits for r in runs),
        "wait_seconds": sum(r.wait_seconds for r in runs),
        "ttft_s": statistics.mean(r.ttft for r in runs),
        "verify_batch_sizes": histogram,
        "per_prompt": {p: statistics.mean(r.tokens_per_second for r in runs if r.prompt == p)
                       for p in dict.fromkeys(r.prompt for r in runs)},
    }
    if entry["token_acceptance"] is not None and costs:
        rate, k = ideal_rate(entry["token_acceptance"], costs)
        # The bound counts decode time only, so it is compared with the rate after the first token.
        entry["ideal"] = {"tokens_per_second": rate, "best_k": k,
                          "fraction": entry["decode_tokens_per_second"] / rate}
        if draft_s:
            bound = pace_bound(entry["token_acceptance"], costs, draft_s, runs[0].link_delay_ms / 1000)
            entry["pace_bound"] = {"tokens_per_second": bound.tokens_per_second, "best_k": bound.k,
                                   "wait_s": bound.wait_s,
                                   "fraction": entry["decode_tokens_per_second"] / bound.tokens_per_second}
    times = summarise_step_times(runs)
    if times is not None:
        entry["step_times"] = times
    cpu = [r.draft_cpu_s for r in runs if r.draft_cpu_s is not None]
    if cpu:  # a batch's draft time is counted once per request in it: the share of the batch's wall time
        entry["draft_cpu_share"] = sum(cpu) / sum(r.seconds for r in runs if r.draft_cpu_s is not None)
    return entry


def is_llama_server(mode: str) -> bool:
    return mode.startswith(PEER_BASE)


def peer_ratios(by_label: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Every variant against llama-server alone on the target's cores, by the decode rate (after the first
    token: the prompt's prefill, which duo's prompt cache shortens, is left out) and end to end."""
    base = by_label.get(PEER_BASE)
    if base is None:
        return {}
    return {label: {"decode": v["decode_tokens_per_second"] / base["decode_tokens_per_second"],
                    "end_to_end": v["tokens_per_second"] / base["tokens_per_second"]}
            for label, v in by_label.items()}


def best_of(by_label: dict[str, dict], prefix: str) -> str | None:
    """The label, among those starting with `prefix`, with the highest decode rate."""
    labels = [label for label in by_label if label.startswith(prefix)]
    return max(labels, key=lambda label: by_label[label]["decode_tokens_per_second"]) if labels else None


def duo_ratios(by_label: dict[str, dict]) -> dict[str, float]:
    """duo's tok/s over every other variant it can be compared with: those at its own link delay,
    and those that run without a delayed link (the target alone, sync-shared). duo-coupled is left
    to coupled_vs_residual."""
    ratios = {}
    for label, duo in by_label.items():
        if duo["mode"] != "duo":
            continue
        for other_label, other in by_label.items():
            comparable = other["link_delay_ms"] == duo["link_delay_ms"] or other["mode"] in UNDELAYED_MODES
            if other["mode"] not in ("duo", COUPLED_MODE) and comparable:
                ratios[f"{label} / {other_label}"] = duo["tokens_per_second"] / other["tokens_per_second"]
    return ratios


def coupled_vs_residual(by_label: dict[str, dict]) -> list[dict]:
    """duo-coupled against duo at each link delay where both ran: their per-token acceptance and
    tok/s, and coupled's over residual's."""
    pairs = []
    for coupled_label, coupled in by_label.items():
        if coupled["mode"] != COUPLED_MODE:
            continue
        residual_label, residual = next(((label, v) for label, v in by_label.items() if v["mode"] == RESIDUAL_MODE
                                         and v["link_delay_ms"] == coupled["link_delay_ms"]), (None, None))
        if residual is None:
            continue
        pair: dict[str, Any] = {"coupled": coupled_label, "residual": residual_label,
                                "verification": [coupled["verification"], residual["verification"]]}
        for key in ("token_acceptance", "tokens_per_second"):
            pair[key] = {"coupled": coupled[key], "residual": residual[key],
                         "ratio": None if coupled[key] is None or not residual[key] else coupled[key] / residual[key]}
        pairs.append(pair)
    return pairs


def rpc_split(by_label: dict[str, dict]) -> dict | None:
    """alone-rpc against alone-tcores, where both ran: their rates, rpc's over local's, and the split's
    cost per token, 1000/rate(rpc) - 1000/rate(local) ms. By the decode rate (after the first token,
    which the prompt's prefill dominates) where both have one, else end to end; `rate` says which."""
    rpc, local = by_label.get(RPC_MODE), by_label.get(LOCAL_MODE)
    if rpc is None or local is None:
        return None
    key, rate = "decode_tokens_per_second", "decode"
    if not (rpc.get(key) and local.get(key)):
        key, rate = "tokens_per_second", "end to end"
    return {"rpc": RPC_MODE, "local": LOCAL_MODE, "rate": rate,
            "tokens_per_second": {"rpc": rpc[key], "local": local[key], "ratio": rpc[key] / local[key]},
            "per_token_ms": 1000 / rpc[key] - 1000 / local[key],
            "end_to_end_ratio": rpc["tokens_per_second"] / local["tokens_per_second"]}


def rpc_split_line(split: dict) -> str:
    """The table's line for rpc_split's numbers."""
    return (f"rpc split: {split['rpc']} / {split['local']} = {split['tokens_per_second']['ratio']:.2f}x tok/s; "
            f"per-token cost of the split: {split['per_token_ms']:+.1f} ms   ({split['rate']} rate: "
            f"{split['tokens_per_second']['rpc']:.2f} / {split['tokens_per_second']['local']:.2f} tok/s)")


def summarise(runs: list[Run], variants: list[Variant], costs: dict[int, float],
              draft_s: float | None = None) -> dict[str, dict]:
    """Per temperature, kept apart: each variant's summary (in `variants` order) and duo's ratios, over the
    requests sent by one client at a time (bench_concurrency summarises the others)."""
    summary = {}
    for temperature in sorted({r.temperature for r in runs}):
        by_label = {}
        for variant in variants:
            mine = [r for r in runs if r.label == variant.label and r.temperature == temperature and r.concurrency == 1]
            if mine:
                by_label[variant.label] = summarise_variant(mine, costs, draft_s)
        summary[str(temperature)] = {"modes": by_label, "ratios": duo_ratios(by_label),
                                     "coupled_vs_residual": coupled_vs_residual(by_label),
                                     "rpc_split": rpc_split(by_label), "vs_llama_server": peer_ratios(by_label),
                                     "best_llama_server_spec": best_of(by_label, "llama-server-spec-n")}
    return summary


def _compared(numbers: dict) -> str:
    """coupled/residual = ratio, for one of coupled_vs_residual's numbers."""
    ratio = "-" if numbers["ratio"] is None else f"{numbers['ratio']:.2f}x"
    return f"{cell(numbers['coupled'], '.2f')}/{cell(numbers['residual'], '.2f')} = {ratio}"


def print_table(summary: dict[str, dict], costs: dict[int, float], machine: dict) -> None:
    print(f"\nmachine: {machine['cpu']}, {machine['cores']} cores; target on cores {machine['target_cores']}, "
          f"draft on cores {machine['draft_cores']}")
    for temperature, entry in summary.items():
        print(f"\n== temperature {temperature} ==")
        print(f"{'mode':<24}{'verify':>9}{'tok/s':>7}{'decode':>8}{'alpha':>7}{'tok/step':>9}{'alone':>7}"
              f"{'branch':>8}{'waits':>7}{'wait s':>8}{'dcpu':>6}{'ttft':>6}   per prompt tok/s")
        for label, v in entry["modes"].items():
            prompts = "  ".join(f"{t:.2f}" for t in v["per_prompt"].values())
            verification = v.get("verification") or "-"
            print(f"{label:<24}{verification:>9}{v['tokens_per_second']:>7.2f}{v['decode_tokens_per_second']:>8.2f}"
                  f"{cell(v['token_acceptance'], '.2f'):>7}{cell(v['mean_accepted_length'], '.2f'):>9}"
                  f"{cell(v['alone_share'], '.0%'):>7}{cell(v['branch_hit_rate'], '.0%'):>8}"
                  f"{v['waits']:>7}{v['wait_seconds']:>8.2f}{cell(v.get('draft_cpu_share'), '.0%'):>6}"
                  f"{v['ttft_s']:>6.2f}   {prompts}")
        # duo's shares of the ideal and of the pace-aware bound stand in this table alone, beside the breakdown.
        for line in step_table("where the decode time goes, and the bounds:", entry["modes"], "mode"):
            print(f"  {line}")
        for label, v in entry["modes"].items():
            if v["mean_draft_tokens_per_verify"]:
                sizes = " ".join(f"{n}:{c}" for n, c in v["verify_batch_sizes"].items())
                print(f"  {label}: verify batch sizes (tokens:steps) {sizes}")
        for name, ratio in entry["ratios"].items():
            print(f"  {name:<44} {ratio:.2f}x")
        for pair in entry.get("coupled_vs_residual", []):
            kinds = "/".join(k or "-" for k in pair["verification"])
            note = "" if kinds == "coupled/residual" else f", verified {kinds}"
            print(f"  coupled/residual acceptance: {_compared(pair['token_acceptance'])}, "
                  f"tok/s: {_compared(pair['tokens_per_second'])}   ({pair['coupled']} / {pair['residual']}{note})")
        if entry.get("rpc_split"):
            print(f"  {rpc_split_line(entry['rpc_split'])}")
        for label, v in entry["modes"].items():
            if is_llama_server(label) and v["acceptance_rate"] is not None:
                print(f"  {label}: draft tokens accepted / drafted {v['acceptance_rate']:.2f}")
        if entry.get("best_llama_server_spec"):
            print(f"  llama-server-spec, best draft length: {entry['best_llama_server_spec']}")
        for label, ratio in entry.get("vs_llama_server", {}).items():
            print(f"  {label:<24} / {PEER_BASE}: {ratio['decode']:.2f}x decode, {ratio['end_to_end']:.2f}x end to end")
    print("\nverify: how the target verified sampled drafts; alpha: per-token acceptance; tok/step: tokens "
          "committed per verify step;\nalone: share of steps decoded alone; branch: share of rejections whose next "
          "step found a branch;\ndcpu: duo-draft's CPU time over the wall time (1 core busy = 100%)")
    print(LEGEND)
    if costs:
        t1 = costs[1]
        print("verify cost T(n)/T(1): " + "  ".join(f"{n}:{t / t1:.2f}" for n, t in costs.items())
              + f"   (T(1) = {t1 * 1000:.0f} ms)")


def _annotation(v: dict) -> str:
    """The per-variant numbers the chart writes beside its bar."""
    parts = [f"{v['tokens_per_second']:.2f} tok/s"]
    if v.get("verification") in ("coupled", "residual"):
        parts.append(v["verification"])
    if v["token_acceptance"] is not None:
        parts += [f"α {v['token_acceptance']:.2f}", f"{v['mean_accepted_length']:.2f} tok/step",
                  f"alone {v['alone_share']:.0%}", f"branch {cell(v['branch_hit_rate'], '.0%')}",
                  f"waits {v['waits']} ({v['wait_seconds']:.1f}s)"]
    if "ideal" in v:
        parts.append(f"ideal {v['ideal']['fraction']:.0%}")
    if "pace_bound" in v:
        parts.append(f"pace {v['pace_bound']['fraction']:.0%}")
    return "  ".join(parts)


def plot(summary: dict[str, dict], costs: dict[int, float], machine: dict, path: Path) -> None:
    """One panel per temperature (a bar per variant, its numbers beside it) and the verify cost curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(len(entry["modes"]) for entry in summary.values())
    figure, axes = plt.subplots(1, len(summary) + 1, figsize=(9 * len(summary) + 5, 1.5 + 0.45 * rows),
                                gridspec_kw={"width_ratios": [9] * len(summary) + [5]})
    for ax, (temperature, entry) in zip(axes, summary.items()):
        labels = list(entry["modes"])[::-1]  # the first variant on top
        rates = [entry["modes"][label]["tokens_per_second"] for label in labels]
        ax.barh(labels, rates, color=["tab:orange" if "duo" in label else "tab:blue" for label in labels])
        for y, label in enumerate(labels):
            ax.text(0.01 * max(rates), y, _annotation(entry["modes"][label]), va="center", fontsize=7)
        ax.set_xlabel("tokens/s (end to end)")
        ax.set_title(f"temperature {temperature}")
        ax.tick_params(axis="y", labelsize=8)
    ax = axes[-1]
    if costs:
        ns = list(costs)
        ax.plot(ns, [costs[n] / costs[1] for n in ns], marker="o", label="measured T(n)/T(1)")
        ax.plot(ns, ns, linestyle="--", label="n single steps")
    ax.set_xlabel("tokens in one verify batch (n)")
    ax.set_ylabel("cost relative to one step")
    ax.set_title("target verify cost")
    ax.legend(fontsize=8)
    figure.suptitle(f"{machine['cpu']}, {machine['cores']} cores", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
