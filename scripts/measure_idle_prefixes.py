"""A new prompt read while another conversation's prefix waits for its next turn: duo-target (idle prefixes parked in
host memory, the default), duo-target --cache-ram 0 (kept in the KV cache, as duo did before) and llama-server (its
--cache-ram and --cache-idle-slots defaults), one server at a time on the same core, each with no draft.

llama.cpp's unified KV cache attends over every cell up to the highest in use, whichever sequence holds it: a prefix
left in the cache makes every other request's tokens cost as if their context were that long (duo.llama.parking).
Per server, over /completion with token ids:
  1. conversation A's first turn: --first tokens of code, one token out (its prefix then waits, idle);
  2. conversation B: --second tokens of other code, --decode tokens out: B's read (seconds, tokens/s) and decode rate;
  3. A's next turn (A's tokens and a few more): the tokens found cached and the seconds its read took.

    python scripts/measure_idle_prefixes.py --model ~/.cache/duo/models/qwen2.5-coder-1.5b-instruct-f16.gguf \
        --first 8192 --second 2048 --core 1 --json scripts/bench-results/idle-prefixes.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from duo.bench.llama_server import llama_server_binary  # noqa: E402
from duo.bench.machine import machine_info, this_commit  # noqa: E402
from duo.llama.model import Model  # noqa: E402
from duo.net.listening import free_port  # noqa: E402
from measure_context import code_tokens  # noqa: E402  (a script beside this one)

SERVERS = ("duo", "duo-cache-ram-0", "llama-server")


def command(server: str, model: Path, context: int, port: int) -> list[str]:
    if server == "llama-server":
        return [str(llama_server_binary()), "--model", str(model), "--ctx-size", str(context), "--threads", "1",
                "--threads-batch", "1", "--flash-attn", "off", "--host", "127.0.0.1", "--port", str(port)]
    extra = ["--cache-ram", "0"] if server == "duo-cache-ram-0" else []
    return [sys.executable, "-m", "duo.cli.target", "--model", str(model), "--ctx-size", str(context), "--threads",
            "1", "--http", f"127.0.0.1:{port}", *extra]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}); see its log")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout} s")


def complete(url: str, tokens: list[int], n_predict: int) -> dict:
    """llama-server's timings of one greedy /completion of `tokens`."""
    body = json.dumps({"prompt": tokens, "n_predict": n_predict, "temperature": 0, "cache_prompt": True,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=7200) as answer:
        return json.load(answer)["timings"]


@contextlib.contextmanager
def serving(server: str, model: Path, context: int, core: int, logs: Path, settle: float) -> Iterator[str]:
    """`server` (SERVERS) serving `model` on `core`, its log in `logs`: its URL, once it answers and `settle` seconds
    have passed; stopped on exit."""
    port = free_port()
    with open(logs / f"{server}.log", "wb") as out:
        process = subprocess.Popen(command(server, model, context, port), stdout=out, stderr=subprocess.STDOUT,
                                   cwd=ROOT, preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process)
        time.sleep(settle)  # duo-target builds its grammar tokenizer after /health answers: not on the reads' time
        yield url
    finally:
        process.terminate()
        process.wait(60)


def add_server_arguments(parser: argparse.ArgumentParser, servers: tuple[str, ...], logs: str) -> None:
    """The arguments every measure of one server at a time takes: the model, the core, the servers, the settling
    time, where the logs and the JSON go."""
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--core", type=int, default=1, help="the core every server runs on, one at a time")
    parser.add_argument("--servers", nargs="+", choices=servers, default=list(servers))
    parser.add_argument("--settle", type=float, default=30, help="seconds between a server's /health and its reads")
    parser.add_argument("--logs", type=Path, default=Path(logs))
    parser.add_argument("--json", type=Path, default=None)


def parsed(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, Model]:
    """The arguments, with the logs' folder made, and the model loaded for its tokenizer."""
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    return args, Model(args.model, threads=1)


def write_result(args: argparse.Namespace, result: dict) -> None:
    """`result` with the machine and the commit, to --json where given."""
    machine = machine_info(argparse.Namespace(target_cores=[args.core], draft_cores=[]))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "commit": this_commit(), **result}, indent=2) + "\n")


def measure(server: str, model: Path, first: list[int], second: list[int], follow_up: list[int], decode: int,
            core: int, logs: Path, settle: float) -> dict:
    context = len(first) + len(second) + len(follow_up) + decode + 64
    with serving(server, model, context, core, logs, settle) as url:
        a = complete(url, first, 1)
        b = complete(url, second, decode)
        again = complete(url, follow_up, 1)
    row = {"server": server, "a_read_s": a["prompt_ms"] / 1000, "b_read_s": b["prompt_ms"] / 1000,
           "b_read_tok_s": b["prompt_per_second"], "b_decode_tok_s": b["predicted_per_second"],
           "a_next_cached": again.get("cache_n"), "a_next_read_s": again["prompt_ms"] / 1000}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser, SERVERS, "/tmp/duo-idle-prefixes")
    parser.add_argument("--first", type=int, default=8192, help="conversation A's prompt tokens")
    parser.add_argument("--second", type=int, default=2048, help="conversation B's prompt tokens")
    parser.add_argument("--decode", type=int, default=32, help="B's output tokens")
    args, tokenizer = parsed(parser)
    first = code_tokens(tokenizer, args.first)
    second = code_tokens(tokenizer, args.second, start=args.first + 10_000)
    follow_up = first + code_tokens(tokenizer, 16, start=5_000)
    rows = [measure(server, args.model, first, second, follow_up, args.decode, args.core, args.logs, args.settle)
            for server in args.servers]
    write_result(args, {"model": args.model.name, "first": args.first, "second": args.second, "decode": args.decode,
                        "rows": rows})


if __name__ == "__main__":
    main()
