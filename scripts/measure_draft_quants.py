"""Which quantization of the draft is fastest on a CPU core at the same acceptance: the measurement behind the
default draft (duo.models.catalog.default_draft).

For each file type, a copy of the catalog draft is made with llama.cpp's quantizer (kept beside the models), then
  - its cost per token: decoding one token after a 200-token prefix on --core, the copies taking turns round after
    round so that the machine's drift hits them alike (median over rounds);
  - its greedy agreement with the target: the target's greedy answer to each prompt is decoded once, and each copy,
    fed the same tokens, is asked for its argmax at every position: the share that equals the target's token is
    the per-token acceptance of greedy speculation.
A draft whose pace bounds duo (a CPU draft) delivers about agreement / cost: the table's last column, relative to
the catalog draft as published.

    python scripts/measure_draft_quants.py --core 1 --ftypes MOSTLY_Q4_0 MOSTLY_IQ4_NL MOSTLY_Q5_0
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

from duo.bench.timing import measure_verify_costs, pinned
from duo.llama.model import Model
from duo.models import hub
from duo.models.files import convert_ftype

PROMPTS = ["Write a snake game in Python.", "Explain why the sky is blue and why sunsets are red.",
           "Translate to German: The weather is lovely today, so we will walk along the river after lunch.",
           "Summarize: The printing press, invented around 1440, let books be made quickly and cheaply, which "
           "spread literacy and new ideas across Europe within a few decades."]


def copies(draft: Path, ftypes: list[str]) -> dict[str, Path]:
    """The draft as published, and a copy of it in each file type (made once, kept beside it)."""
    made = {"published": draft}
    for ftype in ftypes:
        path = draft.with_name(f"{draft.stem}-{ftype.lower()}.gguf")
        if not path.exists():
            print(f"making {path.name} ...", file=sys.stderr)
            convert_ftype(draft, path, ftype)
        made[ftype] = path
    return made


def costs_per_token(paths: dict[str, Path], core: int, rounds: int) -> dict[str, float]:
    """Median over rounds of each copy's cost of one token, the copies taking turns each round."""
    seen: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, path in paths.items():
            seen[name].append(measure_verify_costs(path, {core}, 1, reps=3)[1])
    return {name: statistics.median(times) for name, times in seen.items()}


def greedy_answer(target: Model, prompt: list[int], n: int) -> list[int]:
    context = target.new_context(len(prompt) + n + 8)
    logits = context.decode(prompt, 0)[-1]
    tokens = []
    for _ in range(n):
        token = int(np.argmax(logits))
        if target.is_end_of_generation(token):
            break
        tokens.append(token)
        logits = context.decode([token], len(prompt) + len(tokens) - 1)[-1]
    context.close()
    return tokens


def agreement(draft: Model, prompt: list[int], answer: list[int]) -> tuple[int, int]:
    """(positions where the draft's argmax is the target's greedy token, positions)."""
    context = draft.new_context(len(prompt) + len(answer) + 8)
    rows = context.decode(prompt + answer, 0, logits_for=range(len(prompt) - 1, len(prompt) + len(answer) - 1))
    context.close()
    return int(sum(int(np.argmax(row)) == token for row, token in zip(rows, answer))), len(answer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=hub.DEFAULT_TARGET)
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--ftypes", nargs="+", default=["MOSTLY_Q4_0", "MOSTLY_IQ4_NL", "MOSTLY_Q5_0"])
    parser.add_argument("--core", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=96, help="greedy answer tokens per prompt")
    args = parser.parse_args()
    paths = copies(hub.resolve_model(args.draft), args.ftypes)
    costs = costs_per_token(paths, args.core, args.rounds)
    with pinned({args.core}):
        target = Model(hub.resolve_model(args.target), device="cpu", threads=1)
        chat = [target.tokenize(target.chat_prompt([{"role": "user", "content": p}])) for p in PROMPTS]
        answers = [greedy_answer(target, prompt, args.tokens) for prompt in chat]
        target.close()
        rates = {}
        for name, path in paths.items():
            draft = Model(path, device="cpu", threads=1)
            hits = [agreement(draft, prompt, answer) for prompt, answer in zip(chat, answers)]
            rates[name] = sum(h for h, _ in hits) / sum(n for _, n in hits)
            draft.close()
    base = rates["published"] / costs["published"]
    print(f"{'copy':<16} {'MB':>6} {'ms/token':>9} {'greedy agreement':>17} {'agreement/cost':>15}")
    for name, path in paths.items():
        print(f"{name:<16} {path.stat().st_size / 2**20:6.0f} {costs[name] * 1000:9.1f} {rates[name]:17.3f} "
              f"{rates[name] / costs[name] / base:14.2f}x")


if __name__ == "__main__":
    main()
