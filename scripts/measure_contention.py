"""What the draft's work on its own core costs the target's verify step: T(n) with the draft's core idle, then with
the draft decoding on it without a pause, as it drafts while the target verifies.

duo's bench measures the verify curve T(n) with the draft at rest, and its free-draft ideal E(k)/T(k + 1) and
pace-aware bound take that curve as the cost of a step. Served, the draft works beside each verify (its CPU time is
the bench's `dcpu`), and two cores share the memory bus and caches (and, in a VM, maybe one physical core): the
served step may cost more than the curve says. This script times both, on the same cores, in one run:

    busy T(n) / idle T(n)   the share by which the draft's work slows a verify step of n tokens

(each the median of --reps calls of n tokens after a 200-token prefix, duo.bench.timing.measure_verify_costs; the
busy draft decodes one token at a time after its own 200-token prefix, rolled back after each, until the target's
timing is done).

    python scripts/measure_contention.py --target ~/.cache/duo/models/qwen2.5-coder-1.5b-instruct-f16.gguf \
        --draft ~/.cache/duo/models/qwen2.5-coder-0.5b-instruct-q4_0.gguf --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from duo.bench.machine import cpu_model, this_commit
from duo.bench.timing import COST_PREFIX, batch_tokens, measure_verify_costs, pinned
from duo.llama.model import Model


def keep_drafting(draft: Path, cores: set[int], ready: Event, stop: Event, tokens: Any) -> None:
    """Decode one token at a time on `cores` until `stop`, as a draft drafting without a pause; `tokens` counts them."""
    with pinned(cores):
        model = Model(draft, device="cpu", threads=len(cores))
        context = model.new_context(1024)
        prefix = model.tokenize(COST_PREFIX)[:200]
        context.decode(prefix, 0, logits_for=[])
        [token] = batch_tokens(model, 1)
        ready.set()
        while not stop.is_set():
            context.decode([token], len(prefix), logits_for=[0])
            context.rollback(len(prefix))
            tokens.value += 1
        context.close()
        model.close()


def busy_costs(target: Path, draft: Path, target_cores: set[int], draft_cores: set[int], max_batch: int,
               reps: int) -> tuple[dict[int, float], int, float]:
    """T(n) with the draft decoding on `draft_cores` all along, the tokens it decoded meanwhile and its seconds per
    token."""
    spawn = multiprocessing.get_context("spawn")  # a fresh process: no llama.cpp state shared with this one
    ready, stop, tokens = spawn.Event(), spawn.Event(), spawn.Value("l", 0)
    drafting = spawn.Process(target=keep_drafting, args=(draft, draft_cores, ready, stop, tokens), daemon=True)
    drafting.start()
    try:
        if not ready.wait(300):
            raise SystemExit("the draft did not load within 300 s")
        began, counted = time.perf_counter(), tokens.value
        costs = measure_verify_costs(target, target_cores, max_batch, reps)
        seconds, drafted = time.perf_counter() - began, tokens.value - counted
    finally:
        stop.set()
        drafting.join(60)
    return costs, drafted, seconds / max(drafted, 1)


def contention(idle: dict[int, float], busy: dict[int, float]) -> dict[int, float]:
    """busy T(n) / idle T(n) per n."""
    return {n: busy[n] / idle[n] for n in idle}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--target-core", type=int, default=1)
    parser.add_argument("--draft-core", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    target_cores, draft_cores = {args.target_core}, {args.draft_core}
    idle = measure_verify_costs(args.target, target_cores, args.max_batch, args.reps)
    busy, drafted, draft_s = busy_costs(args.target, args.draft, target_cores, draft_cores, args.max_batch, args.reps)
    ratios = contention(idle, busy)
    for n in idle:
        print(f"T({n}): idle {idle[n] * 1000:7.1f} ms   draft busy {busy[n] * 1000:7.1f} ms   x{ratios[n]:.3f}")
    print(f"the draft meanwhile: {drafted} tokens, {draft_s * 1000:.1f} ms a token")
    result = {"commit": this_commit(), "cpu": cpu_model(), "target": str(args.target), "draft": str(args.draft),
              "cores": {"target": args.target_core, "draft": args.draft_core}, "reps": args.reps,
              "idle_s": idle, "busy_s": busy, "busy_over_idle": ratios, "draft_tokens": drafted,
              "draft_token_s": draft_s}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
