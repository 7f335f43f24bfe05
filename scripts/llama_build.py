#!/usr/bin/env python3
"""Builds of llama.cpp that duo makes: the llama-cpp-python wheel it runs on, and llama.cpp's own
llama-server for `duo bench`, both from the same pinned source, cached by version and flags.

Standard library only: scripts/setup.sh runs it with the system's python3 before the venv has anything.

    python3 scripts/llama_build.py wheel --venv .venv      # install (building once) the wheel duo needs
    python3 scripts/llama_build.py server                  # print the path of a cached llama-server

Why the compiler flags: llama.cpp compiles with -march=native, and on Intel CPUs with AMX (Sapphire
Rapids and later) that compiles ggml's AMX matrix kernels, which crash on batches of 2 to 8 tokens
(llama.cpp issue 20824): exactly duo's verify batches. GCC and Clang let an explicit -mno-<isa> win over
what -march implies whatever the order, so "-march=native -mno-amx-*" keeps every other instruction of
the CPU and drops AMX alone; on a CPU without AMX it compiles the very same code.

Which CMAKE_ARGS: those of the environment when CMAKE_ARGS is set (even to ""), else those of the build
installed in the venv, so that `CMAKE_ARGS=-DGGML_CUDA=on scripts/setup.sh` installs a CUDA build and a
later plain `scripts/setup.sh` (run by scripts/test.sh, say) keeps it. ggml's RPC backend is always on.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python, as pinned in pyproject.toml
ALWAYS = "-DGGML_RPC=on"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
RECORD = "duo-llama-build.json"  # in the venv, and beside each cached wheel
CACHE = Path(os.environ.get("DUO_BUILD_CACHE", Path.home() / ".cache" / "duo"))


@dataclass(frozen=True)
class Build:
    """What a build of llama.cpp is made from: equal Builds give the same binaries."""
    version: str
    cmake_args: str  # the user's own (a GPU backend, say); ALWAYS is added to them
    cflags: str      # for both the C and the C++ compiler

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]

    @property
    def all_cmake_args(self) -> str:
        return f"{ALWAYS} {self.cmake_args}".strip()

    def env(self) -> dict[str, str]:
        """The environment to build in: the user's compiler flags, then this build's."""
        def with_ours(name: str) -> str:
            return " ".join(filter(None, [os.environ.get(name, ""), self.cflags]))

        return {**os.environ, "CMAKE_ARGS": self.all_cmake_args, "CFLAGS": with_ours("CFLAGS"),
                "CXXFLAGS": with_ours("CXXFLAGS")}


def safe_cflags(machine: str, compiler_knows_amx: bool) -> str:
    """The flags that keep ggml's AMX kernels out of an x86 build (none elsewhere: only x86 has AMX,
    and a compiler that does not know AMX cannot compile the kernels anyway)."""
    is_x86 = machine.lower() in ("x86_64", "amd64", "i686", "i386")
    return NO_AMX if is_x86 and compiler_knows_amx else ""


def this_machines_cflags() -> str:
    return safe_cflags(platform.machine(), compiler_knows_amx())


def compiler_knows_amx(compiler: str = "cc") -> bool:
    try:
        return subprocess.run([compiler, *NO_AMX.split(), "-x", "c", "-c", "-o", os.devnull, "-"],
                              input=b"int x;\n", capture_output=True).returncode == 0
    except OSError:
        return False


def wanted_build(requested_cmake_args: str | None, installed: Build | None, cflags: str) -> Build:
    """The build to have: the CMAKE_ARGS asked for, else those of the installed build (see the top)."""
    if requested_cmake_args is None:
        user_args = installed.cmake_args if installed else ""
    else:
        user_args = " ".join(arg for arg in shlex.split(requested_cmake_args) if arg != ALWAYS)
    return Build(VERSION, user_args, cflags)


def read_record(path: Path) -> Build | None:
    try:
        return Build(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def wheel_action(installed: Build | None, wanted: Build, has_rpc: bool, cached: bool) -> str:
    """'keep' the installed wheel, 'install' the cached one, or 'build' it first. A llama-cpp-python
    that duo did not build (no record: pip's, or an older duo's, -march=native with AMX) is replaced."""
    if installed == wanted and has_rpc:
        return "keep"
    return "install" if cached else "build"


def venv_has_rpc(python: Path) -> bool:
    probe = "import llama_cpp, sys; sys.exit(not llama_cpp.llama_supports_rpc())"
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def run(command: list[str], **kwargs) -> None:
    subprocess.run(command, check=True, **kwargs)


def ensure_wheel(venv: Path) -> None:
    python, record = venv / "bin" / "python", venv / RECORD
    installed = read_record(record)
    wanted = wanted_build(os.environ.get("CMAKE_ARGS"), installed, this_machines_cflags())
    wheels = CACHE / "wheels" / wanted.key
    cached = sorted(wheels.glob(f"llama_cpp_python-{VERSION}-*.whl"))
    action = wheel_action(installed, wanted, venv_has_rpc(python), bool(cached))
    if action == "keep":
        return
    if action == "build":
        print(f"building llama-cpp-python {VERSION} with CMAKE_ARGS=\"{wanted.all_cmake_args}\" "
              f"CFLAGS=\"{wanted.cflags}\" (about 6 minutes on 2 cores; once per set of flags) ...", flush=True)
        started = time.monotonic()
        run([str(python), "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-cache-dir", "--no-binary",
             "llama-cpp-python", f"llama-cpp-python=={VERSION}", "-w", str(wheels)], env=wanted.env())
        (wheels / RECORD).write_text(json.dumps(asdict(wanted)))
        print(f"built in {time.monotonic() - started:.0f} s, kept in {wheels}", flush=True)
        cached = sorted(wheels.glob(f"llama_cpp_python-{VERSION}-*.whl"))
    run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--force-reinstall",
         "--no-deps", str(cached[-1])])
    record.write_text(json.dumps(asdict(wanted)))


def ensure_server(cmake_args: str | None) -> Path:
    """llama.cpp's llama-server from the llama.cpp that the pinned llama-cpp-python vendors (same ggml,
    same flags as duo's wheel), built once into the cache: statically linked, no curl, no web UI."""
    build = wanted_build(cmake_args, None, this_machines_cflags())
    binary = CACHE / "llama-server" / build.key / "llama-server"
    if binary.exists():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    with open(binary.parent / "build.lock", "a+") as lock:
        # Another process (a second pytest worker) building the same binary: wait for its build, not a second one
        # beside it on the same cores.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            build_server(build, binary)
    return binary


def build_server(build: Build, binary: Path) -> None:
    """Compile llama-server for `build` into `binary` (renamed into place whole)."""
    print(f"building llama-server from llama-cpp-python {VERSION}'s llama.cpp with \"{build.all_cmake_args}\" "
          f"CFLAGS=\"{build.cflags}\" (about 8 minutes on 2 cores; once per set of flags) ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as work:
        run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={VERSION}", "-d", work])
        with tarfile.open(next(Path(work).glob("llama_cpp_python-*.tar.gz"))) as archive:
            archive.extractall(work, filter="data")
        source = next(Path(work).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        out = Path(work) / "build"
        options = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON",
                   "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF",
                   "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", *shlex.split(build.all_cmake_args)]
        run(["cmake", "-S", str(source), "-B", str(out), "--log-level=WARNING", *options], env=build.env(),
            stdout=subprocess.DEVNULL)
        run(["cmake", "--build", str(out), "--target", "llama-server", "-j", str(os.cpu_count() or 1)],
            env=build.env(), stdout=subprocess.DEVNULL)
        shutil.copy2(out / "bin" / "llama-server", binary.with_suffix(".part"))
        binary.with_suffix(".part").rename(binary)
        (binary.parent / RECORD).write_text(json.dumps(asdict(build)))
    print(f"built llama-server in {time.monotonic() - started:.0f} s: {binary}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    wheel = commands.add_parser("wheel", help="install the llama-cpp-python wheel duo needs into a venv")
    wheel.add_argument("--venv", type=Path, default=Path(".venv"))
    commands.add_parser("server", help="print the path of llama-server, building it once")
    args = parser.parse_args(argv)
    if args.command == "wheel":
        ensure_wheel(args.venv)
    else:
        print(ensure_server(os.environ.get("CMAKE_ARGS")))


if __name__ == "__main__":
    main()
