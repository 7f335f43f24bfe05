"""What duo-draft --window buys and costs on a long session: the draft's prompt read and per-token time, and its
acceptance against the target's greedy continuation.

Time (the draft alone, --threads cores): a code prompt (duo's own sources) of --length tokens read into a context
whole, and as a window (duo.draft.window: the first --sink tokens and the last --window ones), then the median time
of one drafted token after each, and what moving the window costs: a shift of half a window (llama.cpp's K-shift,
timed with the token decoded after it) against reading the window again.

Acceptance (--target given): the target's greedy continuation of --continue tokens after the first --accept-length
tokens of the same prompt, computed once; then, for the draft reading the whole context and each window of --windows
(each with sink 0 and --sink), the share of positions where the draft's argmax, given the prompt and the target's
tokens so far, is the target's token (greedy acceptance per position).

    taskset -c 0 python scripts/measure_window.py --draft ~/.cache/duo/models/qwen2.5-coder-0.5b-instruct-q4_0.gguf \
        --target ~/.cache/duo/models/qwen2.5-coder-1.5b-instruct.gguf --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_context import code_tokens, time_call  # noqa: E402

from duo.draft.window import Window  # noqa: E402
from duo.llama.model import N_BATCH, Model  # noqa: E402


def timed_read(model: Model, tokens: list[int], reps: int) -> dict:
    """Seconds to read `tokens` into a fresh context, and the median ms of one token after them."""
    context = model.new_context(len(tokens) + N_BATCH)
    began = time.perf_counter()
    context.decode(tokens, 0)
    read = time.perf_counter() - began
    per_token = statistics.median(time_call(context, len(tokens), tokens[:1]) for _ in range(reps))
    context.close()
    return {"tokens": len(tokens), "read_s": read, "read_tok_s": len(tokens) / read, "t1_ms": 1000 * per_token}


def timed_move(model: Model, tokens: list[int], window: Window, reps: int) -> dict:
    """ms of moving a full window on by half a window: a shift and the token after it, against a re-read."""
    context = model.new_context(window.cells + window.grid + 8)
    view = tokens[:window.sink] + tokens[-window.size:]
    context.decode(view, 0)
    shifts = []
    for rep in range(reps):
        context.decode(tokens[:window.grid], context.n_past)  # grow half a window, then drop it again
        began = time.perf_counter()
        assert context.drop(0, window.sink, window.grid)
        context.decode(tokens[rep:rep + 1], context.n_past)
        shifts.append(time.perf_counter() - began)
        context.rollback(context.n_past - 1)
    began = time.perf_counter()
    context.clear(0)
    context.decode(view[:window.sink] + view[window.sink + window.grid:], 0)
    reread = time.perf_counter() - began
    context.close()
    return {"shift_and_token_ms": 1000 * statistics.median(shifts), "reread_ms": 1000 * reread}


def greedy_continuation(path: str, prompt: list[int], n: int, threads: int) -> tuple[list[int], float]:
    model = Model(path, threads=threads)
    context = model.new_context(len(prompt) + n + 8)
    began = time.perf_counter()
    logits = context.decode(prompt, 0)[0]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = context.decode(out[-1:], context.n_past)[0]
    seconds = time.perf_counter() - began
    context.close()
    model.close()
    return out, seconds


def agreement(model: Model, prompt: list[int], continuation: list[int], window: Window) -> float:
    """Share of the continuation's positions where the draft's argmax, reading `window` of the prompt and the
    target's tokens before it, is the target's token (its offset as duo-draft places it at the continuation's end)."""
    view = window.view(prompt, window.offset_for(len(prompt) + len(continuation)))
    context = model.new_context(len(view) + len(continuation) + 8)
    head = context.decode(view, 0)  # the first position's row: after the prompt alone
    rows = context.decode(continuation[:-1], len(view), logits_for=range(len(continuation) - 1))
    context.close()
    guesses = np.argmax(np.concatenate([head, rows]), axis=1)
    return float(np.mean(guesses == np.asarray(continuation)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default=None, help="also measure acceptance against this target's greedy output")
    parser.add_argument("--length", type=int, default=16384, help="the session timed, in tokens")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--whole", action="store_true", help="also time the whole --length context (minutes)")
    parser.add_argument("--accept-length", type=int, default=6144)
    parser.add_argument("--continue", dest="n_continue", type=int, default=96)
    parser.add_argument("--windows", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--acceptance-only", action="store_true", help="skip the timings")
    parser.add_argument("--continuation", type=Path, default=None, help="keep the target's continuation here")
    args = parser.parse_args()
    tokens_model = Model(args.draft, threads=args.threads)
    tokens = code_tokens(tokens_model, max(args.length, args.accept_length))
    window = Window(args.window, args.sink)
    result: dict = {"draft": args.draft, "length": args.length, "window": args.window, "sink": args.sink}
    if not args.acceptance_only:
        time_window(args, tokens_model, tokens, window, result)
    if args.target:
        measure_acceptance(args, tokens_model, tokens, result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def time_window(args: argparse.Namespace, tokens_model: Model, tokens: list[int], window: Window, result: dict) -> None:
    result["windowed"] = timed_read(tokens_model, window.view(tokens[:args.length],
                                                              window.offset_for(args.length)), args.reps)
    print("windowed:", result["windowed"], flush=True)
    result["move"] = timed_move(tokens_model, tokens[:args.length], window, 3)
    print("moving the window:", result["move"], flush=True)
    if args.whole:
        result["whole"] = timed_read(tokens_model, tokens[:args.length], args.reps)
        print("whole:", result["whole"], flush=True)


def measure_acceptance(args: argparse.Namespace, tokens_model: Model, tokens: list[int], result: dict) -> None:
    """The target's greedy continuation (kept in --continuation, read from there when present), then the draft's
    agreement with it per window, each printed as it comes."""
    prompt = tokens[:args.accept_length]
    if args.continuation and args.continuation.exists():
        continuation = json.loads(args.continuation.read_text())
    else:
        continuation, seconds = greedy_continuation(args.target, prompt, args.n_continue, args.threads)
        print(f"target's continuation of {len(prompt)} tokens: {seconds:.0f} s", flush=True)
        if args.continuation:
            args.continuation.write_text(json.dumps(continuation))
    windows = [("whole", Window())] + [(f"window {size} sink {sink}", Window(size, sink)) for size in args.windows
                                       for sink in (sorted({0, args.sink}) if size == args.window else [args.sink])]
    rows = {}
    for name, window in windows:
        rows[name] = agreement(tokens_model, prompt, continuation, window)
        print(f"  {name}: {rows[name]:.3f} of {len(continuation)} positions", flush=True)
    result["acceptance"] = {"target": args.target, "prompt_tokens": len(prompt), "positions": len(continuation),
                            "greedy_agreement": rows}


if __name__ == "__main__":
    main()
