"""Where the target's decode time goes, per variant: its steps' parts as the target counted them, and the tables.

Each run carries its target's StepTimes (duo/target/request.py, Stats step_*_seconds): from the first token to the
end, every step after the first is *verify* (llama.cpp's decode of the batch), *check* (verifying its rows on the
model thread), *work* (duo's Python on the event loop: planning, building the batch, committing, telling the draft),
*drafts* (waiting for drafts), *queue* (in the batcher beside its call: the others' steps, other work on the model
thread) and *between* (after a step until the next: the event loop, the client). They add up to the decode time.
The commit's *round trip* (a commit that left the request without drafts, until the draft's next chain came)
overlaps them: it is shown apart, as its mean.
"""

from __future__ import annotations

from typing import Protocol, Sequence

PARTS = ("verify", "check", "work", "drafts", "queue", "between")
# The printed columns: queue and between together as "other" (bench.json keeps them apart).
COLUMNS = {"verify": ("verify",), "check": ("check",), "work": ("work",), "drafts": ("drafts",),
           "other": ("queue", "between")}


class Timed(Protocol):
    """A run as report.Run holds it: its verify steps and its target's step times (seconds)."""

    verify_steps: int
    step_seconds: dict[str, float]
    round_trips: int
    round_trip_s: float


def summarise_step_times(runs: Sequence[Timed]) -> dict | None:
    """The parts summed over `runs`: seconds, shares of the decode time they add up to, milliseconds per step after
    the first token; the round trip's count and mean. None where no run has them (llama-server, an older duo)."""
    seconds = {part: sum(run.step_seconds.get(part, 0.0) for run in runs) for part in PARTS}
    decode = sum(seconds.values())
    steps = sum(max(run.verify_steps - 1, 0) for run in runs)  # the first step's token starts the decode
    if decode <= 0 or not steps:
        return None
    round_trips = sum(run.round_trips for run in runs)
    return {"steps": steps, "decode_s": decode, "seconds": seconds,
            "share": {part: s / decode for part, s in seconds.items()},
            "ms_per_step": {part: 1000 * s / steps for part, s in seconds.items()},
            "decode_ms_per_step": 1000 * decode / steps, "round_trips": round_trips,
            "round_trip_ms": 1000 * sum(run.round_trip_s for run in runs) / round_trips if round_trips else None}


def cell(value: float | None, form: str) -> str:
    """A table's cell: `value` formatted, "-" for none (a server that does not report it)."""
    return "-" if value is None else format(value, form)


def _part(times: dict, column: str) -> str:
    """A column's ms per step and share of the decode time: "12.3 (45%)"."""
    parts = COLUMNS[column]
    return f"{sum(times['ms_per_step'][p] for p in parts):.1f} ({sum(times['share'][p] for p in parts):.0%})"


def _bound(entry: dict, key: str) -> str:
    """The bound's tok/s at its best draft length and the share of it reached: "31.2@k6 (64%)"."""
    bound = entry.get(key)
    if bound is None:
        return "-"
    return f"{bound['tokens_per_second']:.1f}@k{bound['best_k']} ({bound['fraction']:.0%})"


BOUND_WIDTH, PART_WIDTH = 17, 14


def step_table(title: str, rows: dict[str, dict], heading: str = "") -> list[str]:
    """A table of summarise_variant entries by row name (`heading` says what they name): decode rate, acceptance,
    the free-draft ideal and the pace-aware bound (tok/s at their best k, and the share of it reached), then where
    the decode time went (ms per step after the first token and share of the decode time, per part) and the
    commit's round trip. Rows without step times or bounds show "-"; no line at all where no row has either."""
    shown = {name: entry for name, entry in rows.items()
             if entry.get("step_times") or entry.get("ideal") or entry.get("pace_bound")}
    if not shown:
        return []
    width = max([12] + [len(name) + 2 for name in shown])
    lines = [title, f"{heading:<{width}}{'decode':>8}{'alpha':>7}{'ideal (share)':>{BOUND_WIDTH}}"
             f"{'pace (share)':>{BOUND_WIDTH}}{'ms/step':>9}" + "".join(f"{column:>{PART_WIDTH}}" for column in COLUMNS)
             + f"{'rtrip ms':>10}"]
    for name, entry in shown.items():
        times = entry.get("step_times")
        parts = "".join(f"{_part(times, column) if times else '-':>{PART_WIDTH}}" for column in COLUMNS)
        lines.append(f"{name:<{width}}{entry['decode_tokens_per_second']:>8.2f}"
                     f"{cell(entry.get('token_acceptance'), '.2f'):>7}{_bound(entry, 'ideal'):>{BOUND_WIDTH}}"
                     f"{_bound(entry, 'pace_bound'):>{BOUND_WIDTH}}"
                     f"{cell(times and times['decode_ms_per_step'], '.1f'):>9}"
                     f"{parts}{cell(times and times['round_trip_ms'], '.1f'):>10}")
    return lines


LEGEND = ("decode: tok/s after the first token; ideal: max_k E(k)/T(k+1) at the measured acceptance, tok/s@k* (share "
          "reached); pace: the pace-aware bound likewise (duo/bench/pace_bound.py: at the draft's measured "
          "speed);\nms/step: decode time per step after the first token; then each part's ms per step and share of "
          "the decode time: verify (llama.cpp's decode), check (verification on the model thread),\nwork (duo on the "
          "event loop), drafts (waiting for drafts), other (in the batcher beside the call, and between steps); "
          "rtrip: a commit's round trip to the draft's next chain (overlaps the parts)")
