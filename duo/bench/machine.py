"""What the bench records of the machine and the code it measured, and the modes this build cannot run."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
from pathlib import Path

from duo.bench.cluster import ROOT


def rpc_supported() -> bool:
    import llama_cpp

    return bool(getattr(llama_cpp, "llama_supports_rpc", lambda: False)())


def check_modes(modes: list[str]) -> None:
    """SystemExit, before anything starts, for a mode this llama-cpp-python cannot run."""
    if "alone-rpc" in modes and not rpc_supported():
        raise SystemExit("bench: alone-rpc splits the target over `duo rpc-server`s, but this llama-cpp-python "
                         "was built without RPC (llama_cpp.llama_supports_rpc() is False): run scripts/setup.sh "
                         "(it builds with CMAKE_ARGS=-DGGML_RPC=on), or leave alone-rpc out of --modes")


def cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it ("AMD EPYC", "Intel(R) Xeon(R) Processor"; elsewhere, as macOS,
    what the platform says)."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine_info(args: argparse.Namespace) -> dict:
    from duo.llama.backends import available_backends
    import llama_cpp

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "target_cores": args.target_cores,
            "draft_cores": args.draft_cores, "backends": available_backends(),
            "llama_cpp_python": llama_cpp.__version__, "rpc": rpc_supported(), "python": platform.python_version()}


def this_commit() -> str:
    """The commit measured, "+dirty" when the work tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
