"""The expectations file rewritten from a llama-server run and a duo run on the same models: the lead's refresh."""

from __future__ import annotations

from pathlib import Path

from conformance.results import PLACE_FIELD, read_expectations, read_results

MODEL_REASON = "model: fails on llama-server too, at the same place, with the same stand-in models"


def expected_lines(llama_junit: Path, duo_junit: Path, expectations_path: Path) -> tuple[list[str], list[str]]:
    """(the expectation lines of the tests duo fails, what is left off and why). A test duo fails is written when its
    reason is a feature duo lacks or an API's owner duo follows (`api:`; both kept from the file: only a person says
    that) or when llama-server fails it at the same place (a `model:` line with that place); the rest are duo's
    differences, which the check must show. A test the runs did not run (a refresh of some files) keeps its line."""
    old = read_expectations(expectations_path)
    llama, duo = read_results(llama_junit), read_results(duo_junit)
    lines, left_off = [], []
    for test in sorted(set(old.tests) | set(duo.outcomes)):
        outcome = duo.outcomes.get(test)
        if outcome is None:
            place = old.places.get(test)
            lines.append(f"{test} | {old.tests[test]}" + (f" | {PLACE_FIELD}{place}" if place else ""))
        if outcome != "failed":
            continue
        reason = old.tests.get(test, "")
        if reason.startswith(("feature: ", "api: ")):
            lines.append(f"{test} | {reason}")
        elif llama.outcomes.get(test) == "failed" and llama.places[test] == duo.places[test]:
            reason = reason if reason.startswith("model: ") else MODEL_REASON
            lines.append(f"{test} | {reason} | {PLACE_FIELD}{llama.places[test]}")
        elif llama.outcomes.get(test) == "failed":
            left_off.append(f"{test}\n      fails on duo at {duo.places[test] or '?'}, on llama-server at "
                            f"{llama.places[test] or '?'} ({duo.messages[test][:160]})")
        else:
            left_off.append(f"{test}\n      {llama.outcomes.get(test, 'not run')} on llama-server; on duo: "
                            f"{duo.places[test] or '?'} ({duo.messages[test][:160]})")
    return lines, left_off


def rewrite(llama_junit: Path, duo_junit: Path, expectations_path: Path) -> int:
    """Rewrite the file's tests (its header and its files not run stay as they are) and print what is left off."""
    lines, left_off = expected_lines(llama_junit, duo_junit, expectations_path)
    text = expectations_path.read_text()
    marker = "\n# Tests"
    head = text[:text.index(marker)] if marker in text else text.rstrip() + "\n"
    expectations_path.write_text(f"{head}{marker} (duo's run against llama-server's on the same stand-in models; "
                                 f"scripts/conformance.sh --refresh)\n" + "".join(f"{line}\n" for line in lines))
    print(f"{expectations_path}: {len(lines)} tests expected to fail")
    for entry in left_off:
        print(f"left off (a difference the check fails on): {entry}")
    return 0
