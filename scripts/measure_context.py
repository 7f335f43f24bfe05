"""What speculation costs as the context grows: each model's verify step T(k) and prefill rate per context length.

For the target and the draft in turn (one at a time, each on --threads cores, so the two never share a core), with
llama.cpp's flash attention as each of --flash-attn says (a context each, their calls timed in turn), a
code prompt (duo's own sources) is read into one context up to each length of --contexts, and at each length:
  prefill   tokens per second reading the stretch from the previous length to this one (chunks of 512, as served)
  T(k)      the median seconds of a call of k tokens after the context (k = 1..--max-k; rolled back after each):
            for the target a verify step of k - 1 drafts, for the draft one drafted token (k = 1)
Then per length, from those: how the target's verify step grows (T(k)/T(1)), the draft's per-token time against
the target's, and the ideal speedup of parallel speculation at a per-token acceptance --alpha,
    max_k E(k) T_t(1) / max(T_t(k + 1), k T_d(1)),   E(k) = (1 - alpha^(k+1)) / (1 - alpha)
(the draft drafting k tokens on its own core while the target verifies the last k: whichever is slower sets the
pace), and the draft's prefill time of the whole prompt against the target's (the target must not wait for it).

    python scripts/measure_context.py --target ~/.cache/duo/models/qwen2.5-coder-1.5b-instruct.gguf \
        --draft ~/.cache/duo/models/qwen2.5-coder-0.5b-instruct-q4_0.gguf --contexts 1024 4096 8192 16384 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from duo.llama.model import Model

ROOT = Path(__file__).resolve().parent.parent


def code_tokens(model: Model, count: int, start: int = 0) -> list[int]:
    """`count` tokens of Python source from token `start` on (duo's own files, repeated if need be)."""
    text = "".join(path.read_text() for path in sorted((ROOT / "duo").rglob("*.py")))
    tokens = model.tokenize(text, add_special=False)
    while len(tokens) < start + count:
        tokens += tokens
    return tokens[start:start + count]


def time_call(context, pos: int, tokens: list[int]) -> float:
    """Seconds of decoding `tokens` at `pos` with a row for each (a verify step's shape), rolled back after."""
    began = time.perf_counter()
    context.decode(tokens, pos, logits_for=list(range(len(tokens))))
    seconds = time.perf_counter() - began
    context.rollback(pos)
    return seconds


def measure_model(path: str, contexts: list[int], max_k: int, reps: int, threads: int,
                  modes: list[bool | None]) -> dict[str, list[dict]]:
    """Per flash-attention mode (FLASH), per context length: the prefill rate of the stretch before it, and T(k) for
    k = 1..max_k. One context per mode, read alike; the calls of every mode are timed in turn, repetition by
    repetition, so that the machine's noise (other processes on the core) hits all modes alike."""
    model = Model(path, threads=threads)
    held = {mode: model.new_context(max(contexts) + max_k + 8, flash_attn=mode) for mode in modes}
    tokens = code_tokens(model, max(contexts) + max_k)
    rows: dict[str, list[dict]] = {FLASH[mode]: [] for mode in modes}
    pos = 0
    for length in sorted(contexts):
        prefill = {}
        for mode, context in held.items():
            began = time.perf_counter()
            context.decode(tokens[pos:length], pos)
            prefill[mode] = time.perf_counter() - began
        times: dict[tuple[bool | None, int], list[float]] = {(mode, k): [] for mode in modes
                                                              for k in range(1, max_k + 1)}
        for _ in range(reps):
            for k in range(1, max_k + 1):
                for mode, context in held.items():
                    times[mode, k].append(time_call(context, length, tokens[length:length + k]))
        for mode in modes:
            t_ms = {k: 1000 * statistics.median(times[mode, k]) for k in range(1, max_k + 1)}
            rows[FLASH[mode]].append({"context": length, "prefill_tok_s": (length - pos) / prefill[mode],
                                      "prefill_s": prefill[mode], "t_ms": t_ms})
            print(f"  {Path(path).name}, flash attention {FLASH[mode]}, @ {length}: prefill "
                  f"{(length - pos) / prefill[mode]:.0f} tok/s, T(1) {t_ms[1]:.1f} ms, T({max_k}) {t_ms[max_k]:.1f} ms",
                  flush=True)
        pos = length
    for context in held.values():
        context.close()
    model.close()
    return rows


FLASH = {None: "auto", True: "on", False: "off"}


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify step of k drafts commits at per-token acceptance alpha (the bonus token included)."""
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def ideal_speedup(target: dict, draft: dict, alpha: float, max_k: int) -> tuple[float, int]:
    """(the best ideal speedup over decoding alone, its k) of parallel speculation at this context."""
    t1, d1 = target["t_ms"][1], draft["t_ms"][1]
    best = max((expected_tokens(alpha, k) * t1 / max(target["t_ms"][k + 1], k * d1), k) for k in range(1, max_k))
    return best


def table(targets: list[dict], drafts: list[dict], alpha: float, max_k: int) -> str:
    head = ("context | target prefill tok/s | draft prefill tok/s | T_t(1) ms | T_t(k)/T_t(1), k=2.." + str(max_k)
            + f" | T_d(1) ms | T_d(1)/T_t(1) | ideal speedup @alpha={alpha} (k)")
    lines = [head, "-" * len(head)]
    for target, draft in zip(targets, drafts):
        t1 = target["t_ms"][1]
        ratios = " ".join(f"{target['t_ms'][k] / t1:.2f}" for k in range(2, max_k + 1))
        speedup, k = ideal_speedup(target, draft, alpha, max_k)
        lines.append(f"{target['context']:>7} | {target['prefill_tok_s']:>19.0f} | {draft['prefill_tok_s']:>19.0f} | "
                     f"{t1:>9.1f} | {ratios} | {draft['t_ms'][1]:>8.1f} | {draft['t_ms'][1] / t1:>13.2f} | "
                     f"{speedup:.2f}x ({k})")
    whole_t = sum(row["prefill_s"] for row in targets)
    whole_d = sum(row["prefill_s"] for row in drafts)
    lines.append(f"whole prompt of {targets[-1]['context']} tokens: target prefill {whole_t:.0f} s, "
                 f"draft prefill {whole_d:.0f} s ({whole_d / whole_t:.2f} of the target's)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the target's GGUF")
    parser.add_argument("--draft", required=True, help="the draft's GGUF")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--max-k", type=int, default=8, help="longest call timed (a verify of max-k - 1 drafts)")
    parser.add_argument("--reps", type=int, default=5, help="calls timed per k (the median is kept)")
    parser.add_argument("--threads", type=int, default=1, help="cores each model uses (one at a time)")
    parser.add_argument("--alpha", type=float, default=0.8, help="per-token acceptance for the ideal speedup")
    parser.add_argument("--flash-attn", nargs="+", choices=["auto", "on", "off"], default=["on", "off"],
                        help="llama.cpp's flash attention for both models, a table each (auto: duo's default, off "
                             "on a CPU; default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, help="also write the measurements here")
    args = parser.parse_args()
    modes = [{"auto": None, "on": True, "off": False}[mode] for mode in args.flash_attn]
    print("target:", flush=True)
    targets = measure_model(args.target, args.contexts, args.max_k, args.reps, args.threads, modes)
    print("draft:", flush=True)
    drafts = measure_model(args.draft, args.contexts, args.max_k, args.reps, args.threads, modes)
    for mode in targets:
        print(f"flash attention {mode}:\n{table(targets[mode], drafts[mode], args.alpha, args.max_k)}")
    if args.json:
        args.json.write_text(json.dumps({"target": args.target, "draft": args.draft, "threads": args.threads,
                                         "alpha": args.alpha, "reps": args.reps, "targets": targets,
                                         "drafts": drafts}, indent=1))


if __name__ == "__main__":
    main()
