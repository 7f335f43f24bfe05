"""The bench's report per Spec-Bench task group: each mode's tok/s per group and overall, and duo's against its peers.

Per group (and "overall", every question), each variant's summary is report.summarise_variant's over the group's
turns: tok/s end to end is its tokens over its seconds, the decode rate leaves each turn's first token out. Beside
it, "question_mean_tokens_per_second" is Spec-Bench's own number (evaluation/speed.py): each question's tokens
over its seconds, both turns summed, averaged over the questions. The ratios are the bench's (report.duo_ratios:
duo over every other variant, end to end; report.peer_ratios: every variant over llama-server alone, by the
decode rate and end to end), and duo over the fastest llama-server on the same cores as duo's two processes (the
`-all` modes, which spread over every core, left out), end to end. A second table gives duo's share of the ideal and
of the pace-aware bound per group, and where its decode time went (duo.bench.step_times).
"""

from __future__ import annotations

import statistics

from duo.bench.report import PEER_BASE, Run, Variant, duo_ratios, is_llama_server, peer_ratios, summarise_variant
from duo.bench.specbench import GROUPS, group_of
from duo.bench.step_times import step_table

OVERALL = "overall"
DUO, ALONE = "duo", "alone-tcores"  # the labels the printed table compares


def question_mean_rate(runs: list[Run]) -> float:
    """Spec-Bench's tok/s: per question (and repetition), its turns' tokens over their seconds; their mean."""
    answers: dict[tuple[int, int], tuple[int, float]] = {}
    for run in runs:
        tokens, seconds = answers.get((run.question_id, run.rep), (0, 0.0))
        answers[(run.question_id, run.rep)] = (tokens + run.tokens, seconds + run.seconds)
    return statistics.mean(tokens / seconds for tokens, seconds in answers.values())


def best_llama_server(by_label: dict[str, dict]) -> str | None:
    """The llama-server variant on duo's cores (not an -all one) with the highest tok/s end to end."""
    labels = [label for label, v in by_label.items() if is_llama_server(v["mode"]) and not v["mode"].endswith("-all")]
    return max(labels, key=lambda label: by_label[label]["tokens_per_second"]) if labels else None


def summarise_group(runs: list[Run], variants: list[Variant], costs: dict[int, float],
                    draft_s: float | None = None) -> dict:
    """One group's turns: each variant's summary, in `variants` order, and the ratios."""
    by_label = {}
    for variant in variants:
        mine = [r for r in runs if r.label == variant.label]
        if mine:
            by_label[variant.label] = {**summarise_variant(mine, costs, draft_s),
                                       "question_mean_tokens_per_second": question_mean_rate(mine)}
    best = best_llama_server(by_label)
    duo_vs_best = (by_label[DUO]["tokens_per_second"] / by_label[best]["tokens_per_second"]
                   if best and DUO in by_label else None)
    return {"questions": len({r.question_id for r in runs}), "modes": by_label, "ratios": duo_ratios(by_label),
            "vs_llama_server": peer_ratios(by_label), "best_llama_server": best,
            "duo_vs_best_llama_server": duo_vs_best}


def summarise_groups(runs: list[Run], variants: list[Variant], costs: dict[int, float],
                     draft_s: float | None = None) -> dict[str, dict]:
    """Each group that ran, in Spec-Bench's order (any group it does not name after them), then "overall"."""
    ran = {group_of(r.category) for r in runs}
    order = [g for g in GROUPS if g in ran] + sorted(ran - set(GROUPS))
    groups = {g: summarise_group([r for r in runs if group_of(r.category) == g], variants, costs, draft_s)
              for g in order}
    groups[OVERALL] = summarise_group(runs, variants, costs, draft_s)
    return groups


def with_groups(summary: dict[str, dict], runs: list[Run], variants: list[Variant], costs: dict[int, float],
                draft_s: float | None = None) -> dict[str, dict]:
    """`summary` (report.summarise's) with, where the runs are Spec-Bench's, each temperature's groups under
    "groups": summary[T]["groups"][group]["modes"][label]."""
    for temperature, entry in summary.items():
        mine = [r for r in runs if str(r.temperature) == temperature and r.category and r.concurrency == 1]
        if mine:
            entry["groups"] = summarise_groups(mine, variants, costs, draft_s)
    return summary


def _rate(v: dict | None) -> str:
    return "-" if v is None else f"{v['tokens_per_second']:.2f} ({v['question_mean_tokens_per_second']:.2f})"


def _over(by_label: dict[str, dict], other: str | None) -> str:
    """duo's tok/s over `other`'s, end to end, as a table cell."""
    if DUO not in by_label or other not in by_label:
        return "-"
    return f"{by_label[DUO]['tokens_per_second'] / by_label[other]['tokens_per_second']:.2f}x"


def _bound(by_label: dict[str, dict]) -> str:
    """The most speculation can give this group on this machine: the pace-aware bound at duo's measured acceptance
    (duo.bench.pace_bound, decode rate) over the target alone's decode rate, as a table cell."""
    bound = by_label.get(DUO, {}).get("pace_bound")
    if bound is None or ALONE not in by_label:
        return "-"
    return f"{bound['tokens_per_second'] / by_label[ALONE]['decode_tokens_per_second']:.2f}x"


def print_groups(summary: dict[str, dict]) -> None:
    """A table per temperature that ran Spec-Bench: a row per group, a column per variant, then duo's ratios; and
    duo's per group: its share of the ideal and of the pace-aware bound, and where its decode time went
    (duo.bench.step_times)."""
    for temperature, entry in summary.items():
        groups = entry.get("groups")
        if not groups:
            continue
        labels = list(groups[OVERALL]["modes"])
        width = max([16] + [len(label) + 2 for label in labels])
        print(f"\n== Spec-Bench, temperature {temperature}: tok/s end to end (Spec-Bench's per-question mean) ==")
        print(f"{'group':<27}{'n':>4}" + "".join(f"{label:>{width}}" for label in labels)
              + f"{'duo/' + ALONE:>19}{'bound/' + ALONE:>19}{'duo/' + PEER_BASE:>19}{'duo/best llama-server':>24}"
              "   best llama-server")
        for group, g in groups.items():
            modes = g["modes"]
            print(f"{GROUPS.get(group, group):<27}{g['questions']:>4}"
                  + "".join(f"{_rate(modes.get(label)):>{width}}" for label in labels)
                  + f"{_over(modes, ALONE):>19}{_bound(modes):>19}{_over(modes, PEER_BASE):>19}"
                  f"{_over(modes, g['best_llama_server']):>24}"
                  f"   {g['best_llama_server'] or '-'}")
        rows = {GROUPS.get(group, group): g["modes"][DUO] for group, g in groups.items() if DUO in g["modes"]}
        for line in step_table(f"\n== Spec-Bench, temperature {temperature}: duo per group, against the bounds at its "
                               "acceptance there, and where its decode time goes ==", rows, "group"):
            print(line)
    if any(entry.get("groups") for entry in summary.values()):  # the step table's LEGEND: print_table's, just before
        print("n: questions; ratios end to end; bound: the pace-aware bound at duo's acceptance in the group over the "
              "target alone, decode rates (what speculation can give there on this machine);\nbest llama-server: the "
              "fastest on duo's cores (no -all mode); bench.json: summary[T]['groups'][group]")
