"""llama-server's own test suite (llama.cpp's tools/server/tests) run against duo-target: the stand-in `llama-server`
the suite starts, the pytest plugin that keeps it off the hub, the tiny models, and the per-file report.

scripts/conformance.sh drives it; each subcommand is one of its steps:

    conformance.py models DIR               write the tiny stand-in models into DIR (no download)
    conformance.py serve LLAMA-SERVER-ARGS  the suite's `llama-server` (LLAMA_SERVER_BIN_PATH runs it): resolves
                                            the model the suite names to a local file, then runs duo-target (with a
                                            duo-draft beside it in the draft pass) or the real llama-server
    conformance.py report JUNIT EXPECTED    the per-file table; exit 1 when a test off the expectations fails
    conformance.py compare LLAMA DUO EXPECTED   the tests llama-server passes and duo does not (two runs' junit)
    pytest -p conformance                   the plugin: ServerPreset.load_all (the suite's hub download) does nothing

The stand-in reads its settings from the environment the script sets: DUO_CONFORMANCE_SERVER (duo or the path of a
llama-server binary), DUO_CONFORMANCE_TINY / _TINY_DRAFT (the tiny models), DUO_CONFORMANCE_CHAT / _CHAT_DRAFT (the
real chat model and its draft), DUO_CONFORMANCE_DRAFT=1 (attach a duo-draft to every duo-target) and
DUO_CONFORMANCE_ACCEPTANCE (a file where each drafted server adds its draft tokens verified and accepted).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
import xml.etree.ElementTree as ElementTree
from collections import Counter, defaultdict
from pathlib import Path

# The suite's small models (stories260K, stories15M, its infill and MoE variants, bert, jina, tinygemma3): all stand
# in as the tiny random Qwen-tokenizer model. Every other repository is a real chat or tool model: Qwen2.5-Coder-0.5B.
TINY_REPOS = ("ggml-org/test-model-stories260K", "ggml-org/stories15M_MOE", "ggml-org/models", "ggml-org/tiny-llamas",
              "ggml-org/tinygemma3-GGUF")
MODEL_FLAGS = ("-m", "--model", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-mu", "--model-url")
DRAFT_FLAGS = ("-md", "--model-draft")
# What the stand-in drops on the way to duo-target, each with why (the report names these as duo's differences):
# --no-jinja: the suite passes it to every server that does not ask for --jinja, and duo-target (Jinja only)
# refuses it; --spec-type: llama-server's kind of draft, where duo's is the duo-draft that -md starts below.
DROPPED_FOR_DUO = {"--no-jinja": 0, "--spec-type": 1}
# duo-target's settings that llama-server has no flag for: its gRPC port (any free one: servers of consecutive
# tests overlap while one stops) and a short stop, as llama-server stops at once on SIGTERM.
DUO_EXTRA = ["--listen", "127.0.0.1:0", "--shutdown-grace", "1"]
PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------------------------------------------------
# the stand-in llama-server


def split_model_flags(argv: list[str]) -> tuple[dict[str, str], str | None, list[str]]:
    """(the model flags given, by name; the -md file; every other argument), from llama-server's argv."""
    model: dict[str, str] = {}
    draft = None
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg in MODEL_FLAGS:
            model[arg.lstrip("-")] = next(args)
        elif arg in DRAFT_FLAGS:
            draft = next(args)
        else:
            rest.append(arg)
    return model, draft, rest


def local_model(flags: dict[str, str], env: dict[str, str]) -> str:
    """The local GGUF standing in for the model the suite names (a path that exists is kept as it is)."""
    path = flags.get("m") or flags.get("model")
    if path and Path(path).exists():
        return path
    reference = " ".join(flags.values())
    tiny = any(repo.lower() in reference.lower() for repo in TINY_REPOS)
    return env["DUO_CONFORMANCE_TINY" if tiny else "DUO_CONFORMANCE_CHAT"]


def draft_for(model: str, env: dict[str, str]) -> str:
    """The draft a duo-target serving `model` gets in the draft pass (same vocabulary)."""
    return env["DUO_CONFORMANCE_CHAT_DRAFT" if model == env["DUO_CONFORMANCE_CHAT"] else "DUO_CONFORMANCE_TINY_DRAFT"]


def duo_arguments(rest: list[str]) -> list[str]:
    """llama-server's other flags as duo-target takes them: as they are (duo-target reads llama-server's flags), less
    DROPPED_FOR_DUO; an explicit -np keeps llama-server's meaning of -c (the total, not unified)."""
    kept: list[str] = []
    args = iter(rest)
    for arg in args:
        if arg in DROPPED_FOR_DUO:
            for _ in range(DROPPED_FOR_DUO[arg]):
                next(args)
        else:
            kept.append(arg)
    if {"-np", "--parallel"} & set(kept) and not {"-kvu", "--kv-unified"} & set(kept):
        kept.append("--no-kv-unified")
    return kept + DUO_EXTRA


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def die_with_parent() -> None:
    """Runs in a child before exec: the kernel sends it SIGTERM when the stand-in goes (even by SIGKILL)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def option(argv: list[str], names: tuple[str, ...], default: str) -> str:
    for index, arg in enumerate(argv[:-1]):
        if arg in names:
            return argv[index + 1]
    return default


def record_acceptance(argv: list[str], env: dict[str, str]) -> None:
    """Add this server's draft tokens verified and accepted (its /metrics) to DUO_CONFORMANCE_ACCEPTANCE."""
    host = option(argv, ("--host",), "127.0.0.1").split(",")[0]
    url = f"http://{host}:{option(argv, ('--port',), '8080')}/metrics"
    try:
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError as error:
        text = f"# {url}: {error}"
    counts = {name: sum(float(value) for value in re.findall(rf"^duo:spec_decode_{name}_total(?:{{[^}}]*}})? (\S+)$",
                                                             text, re.M))
              for name in ("num_draft_tokens", "num_accepted_tokens")}
    test = env.get("PYTEST_CURRENT_TEST", "? (call)").rsplit(" ", 1)[0]
    with open(env["DUO_CONFORMANCE_ACCEPTANCE"], "a") as out:
        out.write(f"{test}\t{counts['num_draft_tokens']:.0f}\t{counts['num_accepted_tokens']:.0f}\n")


def serve_with_draft(target: list[str], draft: list[str], env: dict[str, str]) -> int:
    """Run duo-draft and duo-target (dialling it) until the suite stops us; note the draft's acceptance first."""
    children = [subprocess.Popen(draft, preexec_fn=die_with_parent, env=env)]
    children.append(subprocess.Popen(target, preexec_fn=die_with_parent, env=env))
    stopping = []

    def stop(signum: int, frame: object) -> None:
        stopping.append(signum)
        record_acceptance(target, env)
        for child in reversed(children):
            child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = children[1].wait()
    if not stopping:  # duo-target ended by itself (a refused flag, say): its status is the suite's answer
        children[0].terminate()
    children[0].wait()
    return 0 if stopping else code


def serve(argv: list[str], env: dict[str, str]) -> int:
    """The suite's llama-server: the model it names resolved locally, then the server this pass runs."""
    flags, model_draft, rest = split_model_flags(argv)
    model = local_model(flags, env)
    env.pop("PYTHONPATH", None)  # set for pytest to find the plugin (scripts/), not for the servers
    server = env["DUO_CONFORMANCE_SERVER"]
    if server != "duo":
        draft = ["-md", model_draft] if model_draft else []
        os.execve(server, [server, "-m", model, *draft, *rest], env)
    bin_dir = Path(sys.executable).parent
    target = [str(bin_dir / "duo-target"), "--model", model, *duo_arguments(rest)]
    if not model_draft and env.get("DUO_CONFORMANCE_DRAFT") != "1":
        os.execve(target[0], target, env)
    port = free_port()
    # llama-server's -md FNAME is duo-draft --model FNAME beside duo-target, which dials it.
    draft = [str(bin_dir / "duo-draft"), "--model", model_draft or draft_for(model, env), "--listen",
             f"127.0.0.1:{port}"]
    return serve_with_draft([*target, "--peer", f"127.0.0.1:{port}"], draft, env)


# ---------------------------------------------------------------------------------------------------------------
# the pytest plugin


def pytest_sessionstart(session: object) -> None:
    """The suite's ServerPreset.load_all starts every preset once to download its model from the hub; the stand-in
    serves local files, so there is nothing to fetch (and presets of features duo lacks would stop the session)."""
    utils = sys.modules["utils"]
    utils.ServerPreset.load_all = staticmethod(lambda: None)


# ---------------------------------------------------------------------------------------------------------------
# the tiny models


def write_models(directory: Path, repository: Path) -> None:
    """The tiny stand-ins, made as the project's tests make theirs (tests/helpers/tiny_models.py), with a context
    long enough for the suite's -c 8192 and a Q8_0 embedding (fast: a server starts for every test)."""
    sys.path.insert(0, str(repository / "tests"))
    from helpers.tiny_models import DRAFT_NOISE, DRAFT_SEED, TARGET_SEED, write_tiny_model

    target = write_tiny_model(directory / "tiny.gguf", seed=TARGET_SEED, n_ctx=16384)
    write_tiny_model(directory / "tiny-draft.gguf", seed=DRAFT_SEED, base=target, noise=DRAFT_NOISE)


# ---------------------------------------------------------------------------------------------------------------
# the report


def read_expectations(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """({test id: reason} expected to fail, {file: reason} not run), from lines `ID | reason` (# comments)."""
    tests: dict[str, str] = {}
    files: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        test, _, reason = (part.strip() for part in line.partition(" | "))
        (tests if "::" in test else files)[test] = reason
    return tests, files


def read_results(junit: Path, messages: dict[str, str] | None = None) -> dict[str, str]:
    """{test id: passed, failed or skipped}, from pytest's --junitxml; each failure's message into `messages`."""
    results = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                if messages is not None:
                    messages[test] = " ".join((child.get("message") or "").split())
            elif child.tag == "skipped":
                outcome = "skipped"
        results[test] = outcome
    return results


def acceptance_line(path: Path | None) -> str | None:
    if path is None or not path.exists():
        return None
    rows = [line.split("\t") for line in path.read_text().splitlines() if line.count("\t") == 2]
    drafted = sum(float(row[1]) for row in rows)
    accepted = sum(float(row[2]) for row in rows)
    share = f" ({accepted / drafted:.0%})" if drafted else ""
    return f"drafts: {len(rows)} servers with a duo-draft; {drafted:.0f} draft tokens verified, {accepted:.0f} accepted{share}"


def report(junit: Path, expectations: Path, acceptance: Path | None = None) -> int:
    """Print run / passed / failed / expected-to-fail per file; 1 when a test off the expectations failed."""
    expected, not_run = read_expectations(expectations)
    results = read_results(junit)
    table: dict[str, Counter] = defaultdict(Counter)
    unexpected, stale = [], []
    for test, outcome in sorted(results.items()):
        row = table[test.split("::")[0]]
        row[outcome] += 1
        if outcome == "failed" and test in expected:
            row["expected"] += 1
        elif outcome == "failed":
            unexpected.append(test)
        elif outcome == "passed" and test in expected:
            stale.append(test)
    print(f"{'file':<36} {'run':>5} {'passed':>7} {'failed':>7} {'expected':>9}")
    for file, row in sorted(table.items()):
        print(f"{file:<36} {row['passed'] + row['failed']:>5} {row['passed']:>7} {row['failed']:>7} "
              f"{row['expected']:>9}")
    total = sum(table.values(), Counter())
    print(f"{'all':<36} {total['passed'] + total['failed']:>5} {total['passed']:>7} {total['failed']:>7} "
          f"{total['expected']:>9}")
    for file, reason in sorted(not_run.items()):
        print(f"not run: {file} ({reason})")
    line = acceptance_line(acceptance)
    if line:
        print(line)
    for test in stale:
        print(f"passes now, off the expectations it may come: {test}")
    for test in unexpected:
        print(f"FAILED, not expected: {test}")
    return 1 if unexpected else 0


def compare(llama_junit: Path, duo_junit: Path, expectations: Path) -> int:
    """The tests llama-server passes and duo fails, marked `-` where the expectations already list them: what the
    expectations may hold (with a reason) or what is next to fix. Also the per-file passes of each."""
    expected, _ = read_expectations(expectations)
    why: dict[str, str] = {}
    llama, duo = read_results(llama_junit), read_results(duo_junit, why)
    files = sorted({test.split("::")[0] for test in llama})
    print(f"{'file':<36} {'llama-server':>12} {'duo':>5} {'duo, of those llama-server passes':>35}")
    for file in files:
        theirs = [test for test, outcome in llama.items() if test.startswith(file + "::") and outcome == "passed"]
        ours = [test for test, outcome in duo.items() if test.startswith(file + "::") and outcome == "passed"]
        both = [test for test in theirs if duo.get(test) == "passed"]
        print(f"{file:<36} {len(theirs):>12} {len(ours):>5} {len(both):>35}")
    for test, outcome in sorted(llama.items()):
        if outcome == "passed" and duo.get(test) != "passed":
            print(f"{'-' if test in expected else '!'} {test}\n      {why.get(test, duo.get(test, 'not run'))[:240]}")
    return 0


def main(argv: list[str]) -> int:
    command, *rest = argv
    if command == "serve":
        return serve(rest, dict(os.environ))
    if command == "models":
        write_models(Path(rest[0]), Path(__file__).resolve().parent.parent)
        return 0
    if command == "report":
        return report(Path(rest[0]), Path(rest[1]), Path(rest[2]) if len(rest) > 2 else None)
    if command == "compare":
        return compare(Path(rest[0]), Path(rest[1]), Path(rest[2]))
    print(f"conformance.py: unknown command {command!r} (serve, models, report, compare)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
