"""The suite's `llama-server`: resolves the model it names to a local file and runs duo-target on it with the suite's
flags (a duo-draft beside it in the draft pass), or the real llama-server on the same file.

It reads its settings from the environment scripts/conformance.sh sets: DUO_CONFORMANCE_SERVER (duo or the path of a
llama-server binary), DUO_CONFORMANCE_TINY / _TINY_DRAFT (the tiny models), DUO_CONFORMANCE_CHAT / _CHAT_DRAFT (the
real chat model and its draft; empty where the run downloads no model), DUO_CONFORMANCE_DRAFT=1 (attach a duo-draft
to every duo-target), DUO_CONFORMANCE_THREADS (each server's threads) and DUO_CONFORMANCE_ACCEPTANCE (a file where
each drafted server adds its draft tokens verified and accepted).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

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
    if any(repo.lower() in reference.lower() for repo in TINY_REPOS):
        return env["DUO_CONFORMANCE_TINY"]
    # A run that downloads no model (CI's) serves the tiny one for a real model too: the fast tests that name one
    # (the router preset of test_security's CORS tests) read headers, not the model's words.
    return env.get("DUO_CONFORMANCE_CHAT") or env["DUO_CONFORMANCE_TINY"]


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


def with_threads(argv: list[str], env: dict[str, str]) -> list[str]:
    """`argv` with --threads DUO_CONFORMANCE_THREADS where the suite sets none: the cores shared out between the
    parallel workers' servers, else each would take every core and their llama.cpp threads, which spin while they
    wait, would take turns on them (measured on 2 cores, 2 workers: 10.7 s of CPU a test of
    test_compat_anthropic.py where a test on one core takes 6.6 s in all)."""
    threads = env.get("DUO_CONFORMANCE_THREADS")
    if not threads or {"-t", "--threads"} & set(argv):
        return argv
    return [*argv, "--threads", threads]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def die_with_parent() -> None:
    """Runs in a child before exec: the kernel sends it SIGTERM when the stand-in goes (even by SIGKILL)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# duo-target's line for each request tells its draft tokens accepted of those verified: "accepted 11/85 drafts".
ACCEPTED = re.compile(r"\baccepted (\d+)/(\d+) drafts\b")


class Acceptance:
    """duo-target's log passed on to the suite as it comes, its draft tokens verified and accepted added up on the way
    (read from the log: its /metrics answers 501 unless the test asks for --metrics, as llama-server's does)."""

    def __init__(self) -> None:
        self.verified = 0
        self.accepted = 0

    def relay(self, log: IO[bytes]) -> None:
        for line in iter(log.readline, b""):
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            for accepted, verified in ACCEPTED.findall(line.decode(errors="replace")):
                self.accepted += int(accepted)
                self.verified += int(verified)

    def record(self, env: dict[str, str]) -> None:
        """Add this server's counts to DUO_CONFORMANCE_ACCEPTANCE, under the test that ran it."""
        test = env.get("PYTEST_CURRENT_TEST", "? (call)").rsplit(" ", 1)[0]
        with open(env["DUO_CONFORMANCE_ACCEPTANCE"], "a") as out:
            out.write(f"{test}\t{self.verified}\t{self.accepted}\n")


def serve_with_draft(target: list[str], draft: list[str], env: dict[str, str]) -> int:
    """Run duo-draft and duo-target (dialling it) until the suite stops us; then note the drafts' acceptance."""
    children = [subprocess.Popen(draft, preexec_fn=die_with_parent, env=env)]
    children.append(subprocess.Popen(target, preexec_fn=die_with_parent, env=env, stderr=subprocess.PIPE))
    acceptance = Acceptance()
    relay = threading.Thread(target=acceptance.relay, args=(children[1].stderr,))
    relay.start()
    stopping = []

    def stop(signum: int, frame: object) -> None:
        stopping.append(signum)
        for child in reversed(children):
            child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = children[1].wait()
    relay.join()
    acceptance.record(env)
    if not stopping:  # duo-target ended by itself (a refused flag, say): its status is the suite's answer
        children[0].terminate()
    children[0].wait()
    return 0 if stopping else code


def serve(argv: list[str], env: dict[str, str]) -> int:
    """The suite's llama-server: the model it names resolved locally, then the server this pass runs."""
    flags, model_draft, rest = split_model_flags(argv)
    rest = with_threads(rest, env)
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
    draft = with_threads([str(bin_dir / "duo-draft"), "--model", model_draft or draft_for(model, env), "--listen",
                          f"127.0.0.1:{port}"], env)
    return serve_with_draft([*target, "--peer", f"127.0.0.1:{port}"], draft, env)
