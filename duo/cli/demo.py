"""`duo demo`: pull the default pair, run duo-draft and duo-target locally on their own cores, generate, stop."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

from duo.net._proto import duo_pb2 as pb
from duo.cli.generate import format_stats, stream
from duo.llama.backends import gpu_layers_for
from duo.models import hub
from duo.net.listening import free_port


def split_cores() -> tuple[set[int], set[int]]:
    """(draft cores, target cores): the draft gets a third of the cores (at least one), the target the rest."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) == 1:
        return set(cores), set(cores)
    n_draft = max(1, len(cores) // 3)
    return set(cores[:n_draft]), set(cores[n_draft:])


def spawn(module: str, args: list[str], cores: set[int], log: Path) -> subprocess.Popen:
    """Start a duo process pinned to `cores` (what `taskset -c` does), its output going to `log`."""
    def pin() -> None:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)

    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", module, *args, "--threads", str(len(cores))],
                                stdout=out, stderr=subprocess.STDOUT, preexec_fn=pin)


def wait_until_speculating(address: str, processes: list[subprocess.Popen], timeout: float = 120) -> None:
    """Wait until the target answers and has its draft connected."""
    deadline = time.monotonic() + timeout
    probe = pb.GenerateRequest(prompt="hi", max_tokens=1)
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError("a duo process exited during start-up")
        try:
            last = list(stream(address, probe))[-1]
            if last.stats.draft_connected:
                return
        except (grpc.RpcError, ConnectionError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"duo-target at {address} did not connect to its draft within {timeout:.0f}s")


def run_demo(args: argparse.Namespace) -> int:
    draft_name = args.draft or hub.default_draft(on_gpu=gpu_layers_for(args.device, None) != 0)[0]
    target_path, draft_path = hub.pull([args.target, draft_name])
    draft_cores, target_cores = split_cores()
    draft_address, target_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    logs = hub.duo_home() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"duo-draft on cores {sorted(draft_cores)}, duo-target on cores {sorted(target_cores)}; "
          f"logs in {logs}", file=sys.stderr)
    draft = spawn("duo.cli.draft", ["--model", str(draft_path), "--listen", draft_address, "--device", args.device],
                  draft_cores, logs / "draft.log")
    target = spawn("duo.cli.target", ["--model", str(target_path), "--listen", target_address, "--peer", draft_address,
                                  "--device", "cpu"], target_cores, logs / "target.log")
    try:
        wait_until_speculating(target_address, [draft, target])
        request = pb.GenerateRequest(max_tokens=args.max_tokens, sampling=pb.SamplingParams(temperature=args.temperature))
        request.messages.append(pb.ChatMessage(role="user", content=args.prompt))
        last = pb.GenerateResponse()
        for last in stream(target_address, request):
            print(last.text, end="", flush=True)
        print()
        print(format_stats(last.stats), file=sys.stderr)
        return 0
    except (RuntimeError, grpc.RpcError, ConnectionError) as error:
        print(f"duo demo: {error}; see the logs in {logs}", file=sys.stderr)
        return 1
    finally:
        for process in (target, draft):
            process.terminate()
        for process in (target, draft):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", default="Write a snake game in Python.")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--target", default=hub.DEFAULT_TARGET, help="target model name")
    parser.add_argument("--draft", default=None,
                        help=f"draft model name (default: the fastest for --device: {hub.CPU_DRAFT} on a CPU, "
                             f"{hub.DEFAULT_DRAFT} on a GPU)")
    parser.add_argument("--device", default="auto", help="the draft's device (the target runs on the CPU)")
