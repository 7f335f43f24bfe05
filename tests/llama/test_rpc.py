"""A target split over ggml RPC servers (`duo rpc-server`, duo-target --rpc), with the tiny target."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from duo.llama.backends import rpc_supported
from duo.cli import main as cli
from duo.llama.rpc import parse_endpoints, parse_tensor_split
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.processes import Process, free_port, generate, start, wait_for_draft
from helpers.duo_runs import PROMPTS, stream_and_interrupt

needs_rpc = pytest.mark.skipif(not rpc_supported(), reason="this llama-cpp-python was built without ggml's RPC "
                                                           "backend (scripts/setup.sh builds it with -DGGML_RPC=on)")


def test_rpc_flags_are_checked_and_say_what_is_wrong():
    assert parse_endpoints("a:1, b:2") == ["a:1", "b:2"]
    for bad, words in [("", "at least one"), ("host", "not HOST:PORT"), ("h:0", "not HOST:PORT"), ("h:1,h:1", "twice")]:
        with pytest.raises(ValueError, match=words):
            parse_endpoints(bad)
    assert parse_tensor_split("3,1", 2) == [3.0, 1.0] and parse_tensor_split(None, 2) == []
    for bad in ("1", "1,x", "-1,2", "0,0"):
        with pytest.raises(ValueError, match="--tensor-split"):
            parse_tensor_split(bad, 2)


@pytest.mark.parametrize("listen, words", [("nope", "--listen: 'nope' is not HOST:PORT"),
                                           ("a:1,b:2", "--listen takes one HOST:PORT")])
def test_duo_rpc_server_refuses_a_bad_listen_address_naming_the_flag(listen, words, capsys):
    assert cli.main(["rpc-server", "--listen", listen]) == 2
    assert words in capsys.readouterr().err


def resident_kib(process: Process) -> int:
    status = Path(f"/proc/{process.popen.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


@pytest.fixture(scope="module")
def rpc_servers(process_logs):
    servers = [start("duo.cli.main", ["rpc-server"], process_logs) for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


@needs_rpc
def test_a_target_split_over_two_rpc_servers_gives_the_greedy_output_of_the_target_alone(
        tiny_target, target_model, served_draft, rpc_servers, process_logs):
    endpoints = ",".join(server.address for server in rpc_servers)
    before = [resident_kib(server) for server in rpc_servers]
    split = start("duo.cli.target", ["--model", str(tiny_target), "--rpc", endpoints], process_logs)
    try:
        # The tiny target's weights are 43 MiB, 39 of them in its output layer (151936 x 64 floats), the
        # rest in two small layers: each server now holds a share, and one of them the output layer.
        grown = [resident_kib(server) - kib for server, kib in zip(rpc_servers, before)]
        assert all(kib > 512 for kib in grown) and sum(grown) > 30 * 1024, grown
        for prompt in PROMPTS:
            assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, generate(split.address, prompt)[0], 32), prompt
    finally:
        split.stop()  # a ggml RPC server serves one client at a time
    duo = start("duo.cli.target", ["--model", str(tiny_target), "--rpc", endpoints, "--tensor-split", "1,3",
                                       "--peer", served_draft.address, "--sync", "4"], process_logs)
    try:
        wait_for_draft(duo.address)
        accepted = 0
        for prompt in PROMPTS:
            tokens, last = generate(duo.address, prompt, max_tokens=32)
            assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, tokens, 32), prompt
            accepted += last.stats.draft_tokens_accepted
        assert accepted > 0
    finally:
        duo.stop()


@pytest.mark.parametrize("address", ["a free local port", "10.255.255.1:50052"])
def test_an_unreachable_rpc_server_stops_duo_target_at_start_up_within_seconds_naming_it(tiny_target, address):
    # The free port is taken when the test runs: at collection each pytest worker would name another one.
    address = f"127.0.0.1:{free_port()}" if address == "a free local port" else address
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "duo.cli.target", "--model", str(tiny_target), "--rpc", address,
                           "--listen", f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60)
    if not rpc_supported():
        assert done.returncode == 1 and "-DGGML_RPC=on" in done.stderr
        return
    assert done.returncode == 1 and address in done.stderr and "unreachable" in done.stderr, done.stderr
    assert time.monotonic() - began < 15


@needs_rpc
def test_a_lost_rpc_server_ends_the_generation_with_an_error_and_the_target_says_why(tiny_target, process_logs):
    servers = [start("duo.cli.main", ["rpc-server"], process_logs) for _ in range(2)]
    target = start("duo.cli.target", ["--model", str(tiny_target), "--ctx-size", "4096", "--rpc",
                                          ",".join(server.address for server in servers)], process_logs)
    try:
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            stream_and_interrupt(target.address, PROMPTS[0], 400, servers[1].kill, with_draft=False)
        assert time.monotonic() - began < 60  # nothing hangs
        assert "lost one of its RPC servers" in failed.value.details() and servers[1].address in failed.value.details()
        target.popen.wait(timeout=30)
        assert target.popen.returncode != 0
        assert servers[1].address in target.log() and "restart it once every server runs" in target.log()
    finally:
        target.stop()
        for server in servers:
            server.stop()


@needs_rpc
def test_a_draft_on_an_rpc_device_drafts_for_a_cpu_target_as_one_on_the_cpu_does(
        tiny_target, tiny_draft, target_model, served_draft, process_logs):
    """A ggml RPC device is an offload device like a GPU: the draft's layers, weights and KV cache live in
    its buffers and only logits come back. The draft's proposals after every partial acceptance come from
    that device-side cache rolled back, so a rollback that left rejected tokens in it would lower the
    acceptance below the CPU draft's on the same requests."""
    server = start("duo.cli.main", ["rpc-server"], process_logs)
    offloaded = start("duo.cli.draft", ["--model", str(tiny_draft), "--rpc", server.address], process_logs)
    acceptance = {}
    try:
        placed = next(line for line in offloaded.log().splitlines() if "duo-draft serving" in line)
        assert f"RPC0 ({server.address}," in placed and "2/2 layers offloaded" in placed, placed
        for name, draft in (("rpc", offloaded), ("cpu", served_draft)):
            duo = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, "--sync", "4"],
                        process_logs)
            try:
                wait_for_draft(duo.address)
                accepted = rejected = 0
                for prompt in PROMPTS:
                    tokens, last = generate(duo.address, prompt, max_tokens=32)
                    assert len(tokens) == 32 and leaves_greedy_path_only_at_a_near_tie(target_model, prompt, tokens, 32)
                    accepted += last.stats.draft_tokens_accepted
                    rejected += last.stats.draft_rejections
                assert rejected > 0  # partial acceptances happened: the draft rolled back its cache
                acceptance[name] = accepted / (accepted + rejected)
                if name == "rpc":
                    assert "CPU: 0/2 layers offloaded" in duo.log()
            finally:
                duo.stop()
    finally:
        offloaded.stop()
        server.stop()
    assert acceptance["rpc"] > 0.3 and abs(acceptance["rpc"] - acceptance["cpu"]) < 0.1, acceptance
