"""The suite's results read back (pytest's junit.xml, the expectations file) and the per-file report: the check."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# pytest's long traceback ends with the innermost frame as `path:line: ExceptionType`: where the test failed, and how.
PLACE = re.compile(r"^(\S+?):(\d+): (\w[\w.]*)$", re.MULTILINE)
PLACE_FIELD = "llama-server: "


@dataclass
class Expectations:
    """scripts/conformance-expected.txt: lines `ID | reason` (# comments), a `model:` test with `| llama-server: PLACE`,
    where llama-server's own run fails it (a test failing elsewhere on duo fails for another reason)."""

    tests: dict[str, str] = field(default_factory=dict)   # {test id: reason} expected to fail
    files: dict[str, str] = field(default_factory=dict)   # {file: reason} not run
    places: dict[str, str] = field(default_factory=dict)  # {test id: where llama-server fails it}


@dataclass
class Results:
    """One run's junit.xml: each test's outcome, and each failure's message and place."""

    outcomes: dict[str, str] = field(default_factory=dict)  # {test id: passed, failed or skipped}
    messages: dict[str, str] = field(default_factory=dict)  # {test id: the failure's message, on one line}
    places: dict[str, str] = field(default_factory=dict)    # {test id: `file:line: ExceptionType` of the failure}


def read_expectations(path: Path) -> Expectations:
    expectations = Expectations()
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        test, _, reason = (part.strip() for part in line.partition(" | "))
        reason, _, place = reason.partition(f" | {PLACE_FIELD}")
        if "::" not in test:
            expectations.files[test] = reason
            continue
        expectations.tests[test] = reason
        if place:
            expectations.places[test] = place
    return expectations


def failure_place(traceback: str) -> str:
    """`file:line: ExceptionType` of a failure's innermost frame (a library's path from its package on, so that two
    environments agree), or "" where pytest gave none (a timeout, a crash)."""
    places = PLACE.findall(traceback)
    if not places:
        return ""
    path, line, kind = places[-1]
    return f"{path.rpartition('site-packages/')[2]}:{line}: {kind}"


def read_results(junit: Path) -> Results:
    results = Results()
    for case in ElementTree.parse(junit).iter("testcase"):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                results.messages[test] = " ".join((child.get("message") or "").split())
                results.places[test] = failure_place(child.text or "")
            elif child.tag == "skipped":
                outcome = "skipped"
        results.outcomes[test] = outcome
    return results


def acceptance_line(path: Path | None) -> str | None:
    if path is None or not path.exists():
        return None
    rows = [line.split("\t") for line in path.read_text().splitlines() if line.count("\t") == 2]
    drafted = sum(float(row[1]) for row in rows)
    accepted = sum(float(row[2]) for row in rows)
    share = f" ({accepted / drafted:.0%})" if drafted else ""
    return (f"drafts: {len(rows)} servers with a duo-draft; {drafted:.0f} draft tokens verified, {accepted:.0f} "
            f"accepted{share}")


def print_table(table: dict[str, Counter]) -> None:
    print(f"{'file':<36} {'run':>5} {'passed':>7} {'failed':>7} {'expected':>9}")
    for file, row in sorted(table.items()) + [("all", sum(table.values(), Counter()))]:
        print(f"{file:<36} {row['passed'] + row['failed']:>5} {row['passed']:>7} {row['failed']:>7} "
              f"{row['expected']:>9}")


def report(junit: Path, expectations_path: Path, acceptance: Path | None = None) -> int:
    """Print run / passed / failed / expected-to-fail per file; 1 when a test off the expectations failed, or a
    `model:` test failed elsewhere than where llama-server fails it (the model's assertion may hide a regression)."""
    expectations = read_expectations(expectations_path)
    results = read_results(junit)
    table: dict[str, Counter] = defaultdict(Counter)
    unexpected, elsewhere, stale = [], [], []
    for test, outcome in sorted(results.outcomes.items()):
        row = table[test.split("::")[0]]
        row[outcome] += 1
        place = expectations.places.get(test)
        if outcome == "failed" and place and results.places[test] != place:
            elsewhere.append(f"{test}\n      duo: {results.places[test] or '?'} ({results.messages[test][:160]})"
                             f"\n      llama-server: {place}")
        elif outcome == "failed" and test in expectations.tests:
            row["expected"] += 1
        elif outcome == "failed":
            unexpected.append(f"{test}\n      {results.places[test]} ({results.messages[test][:200]})")
        elif outcome == "passed" and test in expectations.tests:
            stale.append(test)
    print_table(table)
    for file, reason in sorted(expectations.files.items()):
        print(f"not run: {file} ({reason})")
    line = acceptance_line(acceptance)
    if line:
        print(line)
    for test in stale:
        print(f"passes now, off the expectations it may come: {test}")
    for test in elsewhere:
        print(f"FAILED, not where llama-server fails it: {test}")
    for test in unexpected:
        print(f"FAILED, not expected: {test}")
    return 1 if unexpected or elsewhere else 0


def compare(llama_junit: Path, duo_junit: Path, expectations_path: Path) -> int:
    """The tests llama-server passes and duo fails, marked `-` where the expectations already list them: what the
    expectations may hold (with a reason) or what is next to fix. Also the per-file passes of each."""
    expected = read_expectations(expectations_path).tests
    llama, duo = read_results(llama_junit).outcomes, read_results(duo_junit)
    files = sorted({test.split("::")[0] for test in llama})
    print(f"{'file':<36} {'llama-server':>12} {'duo':>5} {'duo, of those llama-server passes':>35}")
    for file in files:
        theirs = [test for test, outcome in llama.items() if test.startswith(file + "::") and outcome == "passed"]
        ours = [test for test, outcome in duo.outcomes.items() if test.startswith(file + "::") and outcome == "passed"]
        both = [test for test in theirs if duo.outcomes.get(test) == "passed"]
        print(f"{file:<36} {len(theirs):>12} {len(ours):>5} {len(both):>35}")
    for test, outcome in sorted(llama.items()):
        if outcome == "passed" and duo.outcomes.get(test) != "passed":
            why = duo.messages.get(test, duo.outcomes.get(test, "not run"))
            print(f"{'-' if test in expected else '!'} {test}\n      {why[:240]}")
    return 0
