"""Start real duo-draft / duo-target processes on localhost for tests, and talk to them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.net.listening import free_port


@dataclass
class Process:
    popen: subprocess.Popen
    address: str
    log_path: Path
    http_url: str = ""  # "http(s)://127.0.0.1:PORT" when started with http=True

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start(module: str, args: list[str], log_dir: Path, *, port: int | None = None, http: bool = False,
          credentials: grpc.ChannelCredentials | None = None, metrics: bool = True) -> Process:
    """Run `python -m module args --listen 127.0.0.1:port` and wait until it serves: duo-target until its
    health check says SERVING (over TLS with `credentials`), duo-draft until it accepts connections.
    With `http`, duo-target also serves its HTTP API on a free port (and /metrics there, unless not `metrics`)."""
    port = port or free_port()
    address = f"127.0.0.1:{port}"
    http_url = ""
    if http:
        http_port = free_port()
        # /metrics on: the tests read duo's counters there (first, so that a test's own --metrics [HOST:]PORT wins).
        args = [*(["--metrics"] if metrics else []), *args, "--http", f"127.0.0.1:{http_port}"]
        http_url = f"{'https' if credentials else 'http'}://127.0.0.1:{http_port}"
    log_path = log_dir / f"{module.split('.')[-1]}-{port}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen([sys.executable, "-m", module, *args, "--listen", address, "--threads", "1"],
                                 stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    process = Process(popen, address, log_path, http_url)
    ready = (lambda: is_serving(address, credentials)) if module == "duo.cli.target" else (lambda: accepts(port))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"{module} exited with {popen.returncode}:\n{process.log()}")
        if ready():
            return process
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"{module} did not start serving:\n{process.log()}")


def accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    return grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)


def health_status(address: str, credentials: grpc.ChannelCredentials | None = None) -> str:
    """The standard gRPC health check's answer for the whole server ("SERVING", "NOT_SERVING"), or
    "UNREACHABLE" when nothing answers."""
    with channel(address, credentials) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def is_serving(address: str, credentials: grpc.ChannelCredentials | None = None) -> bool:
    return health_status(address, credentials) == "SERVING"


def generate(address: str, prompt: str, *, max_tokens: int = 32, temperature: float = 0.0,
             seed: int | None = None, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             timeout: float = 120) -> tuple[list[int], pb.GenerateResponse]:
    """One generation; returns the completion's token ids and the final message (stats, finish reason)."""
    sampling = pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if seed is not None:
        sampling.seed = seed
    request = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, sampling=sampling)
    tokens: list[int] = []
    last = pb.GenerateResponse()
    with grpc.insecure_channel(address) as channel:
        for response in pb_grpc.TargetStub(channel).Generate(request, timeout=timeout):
            tokens.extend(response.token_ids)
            last = response
    return tokens, last


def wait_for_draft(address: str, timeout: float = 30) -> None:
    """Wait until the target at `address` reports its draft connected."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, last = generate(address, "warm up", max_tokens=2)
        if last.stats.draft_connected:
            return
        time.sleep(0.1)
    raise AssertionError(f"the target at {address} never connected to its draft")
