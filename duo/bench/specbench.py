"""`duo bench --prompts spec-bench`: Spec-Bench's questions as conversations, sent alike to duo and to llama-server.

Spec-Bench (hemingkx/Spec-Bench, data/spec_bench/question.jsonl) holds one question a line: question_id, category,
turns. It reports per task group, as its evaluation/speed.py does: MT-bench's eight categories (writing, roleplay,
reasoning, math, coding, extraction, stem, humanities) form one group, "mt_bench" (its paper's "Multi-turn
Conversation"); each other category is a group of its own (translation, summarization, qa, math_reasoning, rag).
--per-group N takes the first N questions of each group, in the file's order.

An MT-bench question is a two-turn chat: its first turn, then its second after the model's own first answer (each
mode answers from its own first answer, as Spec-Bench's runs do). The other groups ask their first turn only.
Each turn is a Run of its own: its time to first token is its own prefill (the second turn's holds the first turn
and answer), so the decode rate, after the first token, leaves every prefill out, as it does for the bench's
other prompts; end to end, a group's tok/s is its tokens over its seconds, both turns included. A Run's prompt
is a short label ("writing #81 turn 2"); its category, question_id and turn are in the run record. Every request
asks for at most --max-tokens, and an answer may end earlier (at the model's end of turn): tok/s is per answer.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

from duo.bench.cluster import ROOT, Cluster, Message, generate
from duo.bench.llama_server import PeerServer, peer_generate, run_from_answer
from duo.bench.report import Run, run_from_stats

# Where the data lives beside the repository (../shared/data); --spec-bench names another file.
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec-bench.jsonl"
MT_BENCH = "mt_bench"
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
# Spec-Bench's task groups in its reporting order, with the names its paper gives them.
GROUPS = {MT_BENCH: "Multi-turn Conversation", "translation": "Translation", "summarization": "Summarization",
          "qa": "Question Answering", "math_reasoning": "Mathematical Reasoning", "rag": "Retrieval-aug. Generation"}
# A turn sent to a cluster: (the turn's text, the conversation before it) -> (its Run, the model's answer).
Ask = Callable[[str, Sequence[Message]], tuple[Run, str]]


def group_of(category: str) -> str:
    """Spec-Bench's task group of a category: "mt_bench" for MT-bench's eight, else the category itself."""
    return MT_BENCH if category in MT_BENCH_CATEGORIES else category


@dataclass(frozen=True)
class Question:
    """One line of Spec-Bench."""

    question_id: int
    category: str
    turns: tuple[str, ...]

    @property
    def group(self) -> str:
        return group_of(self.category)

    def asked_turns(self) -> tuple[str, ...]:
        """The turns the bench asks: both of MT-bench's, the first of any other group's."""
        return self.turns if self.group == MT_BENCH else self.turns[:1]

    def label(self, turn: int) -> str:
        return f"{self.category} #{self.question_id} turn {turn}"


def read_questions(path: Path) -> list[Question]:
    """Spec-Bench's questions, in the file's order; SystemExit where the file is missing."""
    if not path.is_file():
        raise SystemExit(f"bench: no Spec-Bench file at {path} (see ../shared/data/README.md, or name one with "
                         "--spec-bench PATH)")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Question(int(line["question_id"]), line["category"], tuple(line["turns"])) for line in lines]


def pick(questions: list[Question], per_group: int) -> list[Question]:
    """The first `per_group` questions of each group, in the file's order."""
    taken: dict[str, int] = {}
    picked = []
    for question in questions:
        if taken.get(question.group, 0) < per_group:
            taken[question.group] = taken.get(question.group, 0) + 1
            picked.append(question)
    return picked


def converse(ask: Ask, question: Question) -> list[Run]:
    """The question's turns asked one after the other, each after the turns before it and the model's own
    answers to them; a Run per turn, labelled with its question and turn."""
    history: list[Message] = []
    runs = []
    for turn, text in enumerate(question.asked_turns(), 1):
        run, answer = ask(text, tuple(history))
        runs.append(replace(run, prompt=question.label(turn), category=question.category,
                            question_id=question.question_id, turn=turn))
        history += [("user", text), ("assistant", answer)]
    return runs


def ask_turn(cluster: Cluster | PeerServer, text: str, history: Sequence[Message], *, temperature: float, rep: int,
             max_tokens: int) -> tuple[Run, str]:
    """One turn sent to duo (gRPC) or to llama-server (HTTP chat): its Run and the model's answer."""
    if isinstance(cluster, PeerServer):
        answer = peer_generate(cluster.address, text, temperature, max_tokens, history)
        return run_from_answer(cluster.variant, text, temperature, rep, answer), answer.text
    cpu_before = cluster.draft_cpu_seconds()
    generation = generate(cluster.address, text, temperature, max_tokens, history=history)
    run = run_from_stats(cluster.variant, text, temperature, rep, generation.last.stats, generation.seconds,
                         generation.ttft)
    if cpu_before is not None:
        run.draft_cpu_s = cluster.draft_cpu_seconds() - cpu_before
    return run, generation.text


def measure_questions(clusters: list[Cluster | PeerServer], questions: list[Question], temperatures: list[float],
                      reps: int, max_tokens: int, show: Callable[[Run, str], None]) -> list[Run]:
    """Every question's conversation at every temperature, the clusters taking turns question by question so that
    machine noise hits all of them alike (as the bench's other prompts); show(run, mode) as each turn ends. One
    client at a time: each turn is a batch of its own."""
    runs = []
    batches = itertools.count()
    for rep in range(reps):
        for temperature in temperatures:
            for question in questions:
                for cluster in clusters:
                    ask = partial(ask_turn, cluster, temperature=temperature, rep=rep, max_tokens=max_tokens)
                    for run in converse(ask, question):
                        run.batch = next(batches)
                        show(run, cluster.variant.mode)
                        runs.append(run)
    return runs


def add_spec_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of --prompts spec-bench."""
    parser.add_argument("--spec-bench", type=Path, default=SPEC_BENCH, metavar="PATH",
                        help="Spec-Bench's question.jsonl for --prompts spec-bench (default: %(default)s)")
    parser.add_argument("--per-group", type=int, default=1, metavar="N",
                        help="--prompts spec-bench: the first N questions of each Spec-Bench task group "
                             "(default: %(default)s)")


def check_spec_bench_arguments(args: argparse.Namespace) -> None:
    """SystemExit, before anything starts, for flags --prompts spec-bench cannot honour."""
    if args.prompts != "spec-bench":
        return
    if args.per_group < 1:
        raise SystemExit(f"bench: --per-group must be >= 1, not {args.per_group}")
    if args.concurrency != [1]:
        raise SystemExit("bench: --prompts spec-bench sends one conversation at a time: leave --concurrency out")
    read_questions(args.spec_bench)  # a missing file stops the bench before its models load, not after
