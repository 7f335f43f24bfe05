"""The bench's processes: each variant's duo-target, duo-draft and link delay proxy, from this tree or a baseline's.

A baseline (`--baseline-rev REV`) is a git worktree of REV in a temporary folder; its processes run
with that folder first on their module path, with this venv's packages (llama-cpp-python, grpc).
duo and duo-coupled start this tree's duo-target with `--unseeded residual` and `--unseeded coupled`;
the baseline's gets no such flag (revisions before coupled sampling do not know it).
alone-rpc starts two `duo rpc-server`s on the target's cores, waits until both accept connections,
then a duo-target, also on those cores, whose layers they hold half each (--rpc, --tensor-split 1,1).
With clients at once (--concurrency), every duo-target gets --parallel as many as the most clients,
so no request waits inside it for a turn; generate_together sends a batch of requests at once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence, TypeVar

import grpc

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.bench.structured import schema_json, split
from duo.bench.report import Variant
from duo.net.listening import free_port

# The checkout this bench runs from: its duo, its git history (baselines), its scripts/ (llama-server's build).
ROOT = Path(__file__).resolve().parents[2]
DELAY_PROXY = Path(__file__).resolve().parent / "delay_proxy.py"
T = TypeVar("T")
Message = tuple[str, str]  # a chat message: (role, content)
# How each mode's duo-target verifies sampled requests without a seed (the bench sends none).
UNSEEDED = {"duo": "residual", "duo-coupled": "coupled", "duo-nolookup": "residual"}


@dataclass(frozen=True)
class Code:
    """A tree of duo's code and the modules that start its two processes there."""

    root: Path
    target_module: str
    draft_module: str

    @classmethod
    def at(cls, root: Path) -> Code:
        # Commit 621876b moved each process's command line beside its wiring (duo.target / duo.draft before
        # it, duo.target_process / duo.draft_process after); the packages by owner moved them to duo.cli.
        if (root / "duo" / "cli" / "target.py").is_file():
            return cls(root, "duo.cli.target", "duo.cli.draft")
        if (root / "duo" / "target_process.py").is_file():
            return cls(root, "duo.target_process", "duo.draft_process")
        return cls(root, "duo.target", "duo.draft")


@contextlib.contextmanager
def baseline_worktree(rev: str, repo: Path = ROOT) -> Iterator[tuple[Code, str]]:
    """A detached git worktree of `repo` at `rev` (removed on exit), and the commit `rev` names."""
    commit = _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    folder = Path(tempfile.mkdtemp(prefix="duo-baseline-"))
    tree = folder / "duo"
    _git(repo, "worktree", "add", "--detach", str(tree), commit)
    try:
        yield Code.at(tree), commit
    finally:
        _git(repo, "worktree", "remove", "--force", str(tree))
        shutil.rmtree(folder, ignore_errors=True)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@dataclass
class Cluster:
    """The processes of one variant; `address` is its target's client endpoint. `in_turn`: stop
    each process before the next (a target before the RPC servers that hold its layers)."""

    variant: Variant
    address: str
    processes: list[subprocess.Popen] = field(default_factory=list)
    speculative: bool = False
    in_turn: bool = False

    def draft_cpu_seconds(self) -> float | None:
        """CPU seconds duo-draft has spent so far (user and system), None where the variant has none."""
        if not self.speculative:
            return None
        fields = Path(f"/proc/{self.processes[0].pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
            if self.in_turn:
                process.wait(30)
        for process in self.processes:
            process.wait(30)


def spawn(command: list[str], cores: set[int], log: Path, code: Code) -> subprocess.Popen:
    """Start `command` pinned to `cores` (what `taskset -c` does), importing duo from `code.root`,
    its output going to `log`."""
    def pin() -> None:
        os.sched_setaffinity(0, cores)

    # `python -m` puts the working folder first on the module path, PYTHONPATH next: both name
    # code.root, so its duo wins over the one this venv has installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(code.root), os.environ.get("PYTHONPATH")]))}
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, preexec_fn=pin, cwd=code.root, env=env)


def duo_command(module: str, args: list[str], cores: set[int]) -> list[str]:
    """`python -m module args` with as many threads as `cores`."""
    return [sys.executable, "-m", module, *args, "--threads", str(len(cores))]


def _free_ports(n: int, taken: set[int]) -> list[int]:
    """n distinct free ports, none in `taken` (free_port may hand the same one out twice in a row)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports and port not in taken:
            ports.append(port)
    return ports


def wait_listening(endpoints: list[str], processes: list[subprocess.Popen], timeout: float = 60) -> None:
    """Until every HOST:PORT accepts a connection; SystemExit if one of `processes` (their servers)
    exits first or `timeout` passes. A ggml RPC server drops a client that closes before its hello
    and goes back to accepting."""
    deadline = time.monotonic() + timeout
    waiting = list(endpoints)
    while waiting:
        if any(p.poll() is not None for p in processes):
            raise SystemExit(f"an RPC server exited before it listened on {', '.join(waiting)}; see its log")
        host, _, port = waiting[0].rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            waiting.pop(0)
            continue
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the RPC servers at {', '.join(waiting)} did not listen within {timeout:g}s")
        time.sleep(0.2)


def _start_alone_rpc(variant: Variant, code: Code, address: str, target_args: list[str], cores: set[int],
                     name: str, logs: Path) -> Cluster:
    """alone-rpc: two RPC servers and the target, all on the target's cores, each with as many threads
    as those cores; the target's layers split evenly over the servers."""
    endpoints = [f"127.0.0.1:{port}" for port in _free_ports(2, {int(address.rpartition(":")[2])})]
    servers = [spawn(duo_command("duo.cli.main", ["rpc-server", "--listen", endpoint, "--device", "cpu"], cores), cores,
                     logs / f"{name}-server{i}.log", code) for i, endpoint in enumerate(endpoints, 1)]
    try:
        wait_listening(endpoints, servers)
    except SystemExit:
        Cluster(variant, "", servers).stop()
        raise
    target = spawn(duo_command(code.target_module, [*target_args, "--rpc", ",".join(endpoints), "--tensor-split", "1,1"],
                        cores), cores, logs / f"{name}-target.log", code)
    # The target first: stopped before its servers, it does not abort over a lost server.
    return Cluster(variant, address, [target, *servers], in_turn=True)


def start_variant(variant: Variant, code: Code, models: tuple[Path, Path], cores: tuple[set[int], set[int]],
                  sync_k: int, logs: Path, parallel: int | None = None, drafts: int = 1) -> Cluster:
    """Start a variant's processes. `models` and `cores` are (target, draft); a delayed link
    puts a delay proxy, on all cores, between the target and each draft. `parallel`: the target's
    --parallel (None: its default); `drafts`: how many duo-draft processes serve it (split_cores)."""
    (target, draft), (target_cores, draft_cores) = models, cores
    all_cores = set(os.sched_getaffinity(0))
    name = variant.label.replace(" +", "-").replace("@", "-at-")
    address = f"127.0.0.1:{free_port()}"
    target_args = ["--model", str(target), "--listen", address, "--device", "cpu", "--log-level", "WARNING"]
    if parallel is not None:
        target_args += ["--parallel", str(parallel)]
    if variant.mode == "alone-rpc":
        return _start_alone_rpc(variant, code, address, target_args, target_cores, name, logs)
    if variant.mode.startswith("alone") or variant.mode == "lookup-tcores":
        # The target alone is the plain target; lookup-tcores is the same with its context lookup (no draft).
        cores_used = all_cores if variant.mode == "alone-all" else target_cores
        alone_args = target_args + ([] if variant.mode == "lookup-tcores" else ["--no-lookup"])
        return Cluster(variant, address, [spawn(duo_command(code.target_module, alone_args, cores_used), cores_used,
                                                logs / f"{name}.log", code)])
    if variant.mode == "sync-shared":
        target_cores = draft_cores = all_cores
    processes, peers = [], []
    for i, cores_of_draft in enumerate(split_cores(draft_cores, drafts)):
        draft_address = f"127.0.0.1:{free_port()}"
        processes.append(spawn(duo_command(code.draft_module, ["--model", str(draft), "--listen", draft_address, "--device",
                                                        "cpu", "--log-level", "WARNING"], cores_of_draft),
                               cores_of_draft, logs / f"{name}-draft{i or ''}.log", code))
        peer = draft_address
        if variant.link_delay_ms:
            peer = f"127.0.0.1:{free_port()}"
            processes.append(spawn([sys.executable, str(DELAY_PROXY), "--listen", peer, "--upstream", draft_address,
                                    "--delay-ms", str(variant.link_delay_ms)], all_cores,
                                   logs / f"{name}-proxy{i or ''}.log", code))
        peers += ["--peer", peer]
    extra = ["--sync", str(sync_k)] if variant.mode.startswith("sync") else []
    if variant.mode in UNSEEDED:
        extra += ["--unseeded", UNSEEDED[variant.mode]]
    if variant.mode == "duo-nolookup":
        extra += ["--no-lookup"]
    processes.append(spawn(duo_command(code.target_module, [*target_args, *peers, *extra], target_cores),
                           target_cores, logs / f"{name}-target.log", code))
    return Cluster(variant, address, processes, speculative=True)


def split_cores(cores: set[int], n: int) -> list[set[int]]:
    """`n` drafts' cores: the draft cores dealt out in turn, each draft getting at least one (shared when fewer)."""
    ordered = sorted(cores)
    if n <= len(ordered):
        return [set(ordered[i::n]) for i in range(n)]
    return [{ordered[i % len(ordered)]} for i in range(n)]


class Generation(NamedTuple):
    """One of generate's chat generations, as its client saw it."""

    last: pb.GenerateResponse  # the last message, with the target's Stats
    seconds: float  # from the send to the last message
    ttft: float  # from the send to the first token
    text: str  # the answer (a later turn of the conversation carries it)


def chat_request(prompt: str, temperature: float, max_tokens: int, seed: int | None = None,
                 history: Sequence[Message] = ()) -> pb.GenerateRequest:
    """duo's request for `prompt` asked after `history` (a conversation's earlier turns and answers)."""
    sampling = pb.SamplingParams(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    # No prompt cache, as the bench asks llama-server (llama_server.chat_request): a repetition, or a later turn,
    # reads its prompt afresh in every mode, so time to first token compares like with like.
    request = pb.GenerateRequest(max_tokens=max_tokens, sampling=sampling, cache_prompt=False)
    for role, content in history:
        request.messages.append(pb.ChatMessage(role=role, content=content))
    request.messages.append(pb.ChatMessage(role="user", content=split(prompt)[0]))
    if (schema := schema_json(prompt)) is not None:  # the structured workload
        request.grammar.CopyFrom(pb.Grammar(kind="json_schema", source=schema))
    return request


def generate(address: str, prompt: str, temperature: float, max_tokens: int, seed: int | None = None,
             history: Sequence[Message] = ()) -> Generation:
    """One chat generation, timed by the client. Without a seed, the target draws one, and verifies
    a sampled request as its --unseeded says."""
    request = chat_request(prompt, temperature, max_tokens, seed, history)
    started = time.perf_counter()
    first = None
    last = pb.GenerateResponse()
    text = []
    with grpc.insecure_channel(address) as channel:
        for last in pb_grpc.TargetStub(channel).Generate(request, wait_for_ready=True, timeout=3600):
            if first is None and last.token_ids:
                first = time.perf_counter() - started
            text.append(last.text)
    return Generation(last, time.perf_counter() - started, first or 0.0, "".join(text))


class Answer(NamedTuple):
    """One of generate_together's generations."""

    last: pb.GenerateResponse  # the last message, with the target's Stats
    sent_s: float  # when its client sent it, seconds after the first of its batch was sent
    seconds: float  # from its send to its last message
    ttft: float  # from its send to its first token


def released_together(send: Callable[[str], T], prompts: list[str]) -> list[tuple[float, T]]:
    """send(prompt) for each prompt, all at once: a client thread each, released together; each result
    with when its client sent it, in seconds after the first one did."""
    release = threading.Barrier(len(prompts))

    def one(prompt: str) -> tuple[float, T]:
        release.wait()
        return time.perf_counter(), send(prompt)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    first_sent = min(sent for sent, _ in results)
    return [(sent - first_sent, result) for sent, result in results]


def generate_together(address: str, prompts: list[str], temperature: float, max_tokens: int) -> list[Answer]:
    """A generation of each prompt, all at once: a client (thread and channel) each, released together."""
    return [Answer(last, sent_s, seconds, ttft) for sent_s, (last, seconds, ttft, _)
            in released_together(lambda prompt: generate(address, prompt, temperature, max_tokens), prompts)]


def wait_ready(cluster: Cluster, timeout: float = 300) -> None:
    """Until the target answers and, for speculative modes, its draft is connected."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in cluster.processes):
            raise SystemExit(f"{cluster.variant.label}: a process exited; see its log")
        try:
            last = generate(cluster.address, "hi", 0.0, 2, 0).last
            if last.stats.draft_connected or not cluster.speculative:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{cluster.variant.label}: not ready after {timeout}s")
