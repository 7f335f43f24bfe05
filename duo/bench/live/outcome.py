"""What one live agent run came to (its requests and their statuses, the tool calls it got, the drafts verified and
accepted, its first token and wall time, and whether TASK got done), as a JSON record and as the table printed."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from duo.bench.live.proxy import Exchange, json_object
from duo.bench.live.runs import AgentRun
from duo.bench.live.streams import called

OUTPUT_TAIL = 2000  # characters of the client's output kept in the record
SCRIPT = "hello.py"  # what TASK asks the agent to create
Record = dict[str, Any]


@dataclass(frozen=True)
class Drafts:
    """Draft tokens the target verified and accepted (deltas of duo:spec_decode_num_{draft,accepted}_tokens_total)."""

    verified: float = 0.0
    accepted: float = 0.0

    def __sub__(self, earlier: Drafts) -> Drafts:
        return Drafts(self.verified - earlier.verified, self.accepted - earlier.accepted)


def answer_calls(exchange: Exchange) -> list[str]:
    """The names of the tools an answer called, streamed or whole, in any of the three protocols."""
    if exchange.is_stream():
        return [name for _, name in called(exchange.path, exchange.answer)]
    body = json_object(exchange.answer) or {}
    if exchange.path.endswith("/responses"):
        return [item["name"] for item in body.get("output") or [] if item.get("type") == "function_call"]
    if exchange.path.endswith("/messages"):
        return [block["name"] for block in body.get("content") or [] if block.get("type") == "tool_use"]
    return [call["function"]["name"] for choice in body.get("choices") or []
            for call in (choice.get("message") or {}).get("tool_calls") or []]


def task_check(work: Path) -> tuple[bool, str]:
    """Whether TASK is done in `work` (hello.py there, and `python3 hello.py` prints hello), and what was found."""
    script = work / SCRIPT
    if not script.is_file():
        return False, f"no {SCRIPT} in the folder"
    try:
        ran = subprocess.run([sys.executable, SCRIPT], cwd=work, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False, f"python3 {SCRIPT} still running after 30s"
    if ran.returncode != 0:
        return False, f"python3 {SCRIPT} exited {ran.returncode}: {ran.stderr.strip()[-200:]}"
    if "hello" not in ran.stdout.lower():
        return False, f"python3 {SCRIPT} printed {ran.stdout[:200]!r}"
    return True, f"python3 {SCRIPT} printed {ran.stdout.strip()[:200]!r}"


def request_record(exchange: Exchange) -> Record:
    return {"method": exchange.method, "path": exchange.path, "query": exchange.query, "status": exchange.status,
            "stream": exchange.is_stream(), "seconds": round(exchange.seconds, 2),
            "first_token_s": None if exchange.first_token is None else round(exchange.first_token, 2),
            "tool_calls": answer_calls(exchange)}


def record(run: AgentRun, drafts: Drafts | None, work: Path) -> Record:
    """The JSON record of `run`, whose working folder was `work` and during which the target saw `drafts` (None: the
    server ran with no draft, and the record's drafts are null, not a draft that got nothing accepted)."""
    done, why = task_check(work)
    requests = [request_record(e) for e in run.exchanges]
    model_calls = [entry for entry in requests if entry["path"] == run.agent.model_path]
    return {
        "agent": run.agent.name, "package": f"{run.agent.package}@{run.agent.version}", "exit": run.returncode,
        "wall_s": round(run.seconds, 1),
        "statuses": dict(sorted(Counter(str(e.status) for e in run.exchanges).items())),
        "model_calls": len(model_calls),
        "tool_calls": [name for entry in model_calls for name in entry["tool_calls"]],
        "drafts": None if drafts is None else {"verified": drafts.verified, "accepted": drafts.accepted},
        "first_token_s": model_calls[0]["first_token_s"] if model_calls else None,
        "task": {"done": done, "why": why},
        "requests": requests,
        "refused": run.attempts, "folder": str(work), "output_tail": run.output[-OUTPUT_TAIL:],
    }


def last_line(output: str) -> str:
    """The client's last line of output: what it said as it ended."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:160] if lines else "(no output)"


COLUMNS = ("agent", "try", "requests", "statuses", "tool calls", "drafts acc/ver", "1st token", "wall", "task")


def row(entry: Record) -> tuple[str, ...]:
    statuses = " ".join(f"{status}x{n}" for status, n in entry["statuses"].items())
    calls = Counter(entry["tool_calls"])
    tools = ", ".join(f"{name}x{n}" if n > 1 else name for name, n in calls.items()) or "-"
    drafts = entry["drafts"]
    accepted = "no draft" if drafts is None else f"{drafts['accepted']:g}/{drafts['verified']:g}"
    first = "-" if entry["first_token_s"] is None else f"{entry['first_token_s']:.1f}s"
    return (entry["agent"], str(entry.get("attempt", 1)), f"{len(entry['requests'])} ({entry['model_calls']} model)",
            statuses or "-", tools, accepted, first, f"{entry['wall_s']:.0f}s",
            "done" if entry["task"]["done"] else "NOT done")


def table(records: list[Record]) -> str:
    """The runs as a text table, each followed by why its task is (not) done and the client's last line."""
    rows = [COLUMNS] + [row(entry) for entry in records]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = []
    for i, cells in enumerate(rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip())
        if i:
            entry = records[i - 1]
            lines.append(f"    task: {entry['task']['why']}; exit {entry['exit']}; last output: "
                         f"{last_line(entry['output_tail'])}")
    return "\n".join(lines)
