"""The pool's port (duo-target --draft-listen) hands every prompt and output to the drafts that join: other machines
may join only through mutual TLS, an allow list, or a flag that says what it gives away; the start-up log says who
may join; the port bounds its messages and calls; a draft's own name is clipped before it is kept or served. And a
draft that only joins (duo-draft --join) opens no port: two run side by side on one machine."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from duo.net import wire
from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.cli import draft as draft_process
from duo.cli import target as target_process
from duo.cli.target_drafts import ANY_HOST_FLAG, check_draft_flags, who_may_join
from duo.draft.drafter import Drafter
from duo.draft.joining import Joiner
from duo.draft.metrics import DraftMetrics
from duo.draft.service import DraftServicer, SessionLimits
from duo.llama.worker import ModelWorker
from duo.net.listening import free_port
from duo.net.options import grpc_channel_options
from duo.target.pool.link import DraftLink
from duo.target.pool import joined
from duo.target.pool.connection import MAX_MODEL_NAME_CHARS, DraftConnection
from duo.target.pool.joined import MAX_JOIN_MESSAGE_BYTES, PoolService, allowed, parse_allow, peer_host, pool_server
from helpers.pki import write_pki
from helpers.processes import Process, start
from helpers.waiting import until, until_async

# A draft's name as a hostile draft sends it: megabytes, with a line break that would forge a log line.
HOSTILE_NAME = "evil\n2025-01-01 duo.target INFO all is well " * 20_000


def target_args(*flags: str):
    return target_process.build_parser().parse_args(["--listen", "127.0.0.1:0", *flags])


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return write_pki(tmp_path_factory.mktemp("pki"))


def tls_flags(pki, *, ca: bool) -> list[str]:
    return (["--draft-tls-cert", str(pki.server_cert), "--draft-tls-key", str(pki.server_key)]
            + (["--draft-tls-ca", str(pki.ca)] if ca else []))


@pytest.mark.parametrize("case", ["nothing", "TLS without a CA", "an allow list of every address"])
def test_a_draft_listen_other_machines_reach_is_refused_at_start_unless_it_says_who_may_join(
        tmp_path, capsys, pki, case):
    flags = {"nothing": [], "TLS without a CA": tls_flags(pki, ca=False),
             "an allow list of every address": ["--draft-allow", "0.0.0.0/0"]}[case]
    code = target_process.main(["--model", str(tmp_path / "never-loaded.gguf"), "--listen", "127.0.0.1:0",
                                "--draft-listen", "0.0.0.0:0", *flags])
    error = capsys.readouterr().err
    assert code == 1
    assert "reads every prompt and output" in error
    assert all(way in error for way in ("--draft-tls-ca", "--draft-allow", ANY_HOST_FLAG)), error
    if case == "TLS without a CA":
        assert "without --draft-tls-ca any client may join" in error


@pytest.mark.parametrize("listen, case", [
    ("0.0.0.0:0", "mutual TLS"), ("0.0.0.0:0", "an allow list"), ("0.0.0.0:0", "the opt-in"),
    ("127.0.0.1:0", "nothing: loopback"), ("localhost:0", "nothing: loopback"),
])
def test_a_draft_listen_starts_with_mutual_tls_an_allow_list_the_opt_in_or_on_loopback(pki, listen, case):
    flags = {"mutual TLS": tls_flags(pki, ca=True), "an allow list": ["--draft-allow", "10.0.0.0/8"],
             "the opt-in": [ANY_HOST_FLAG], "nothing: loopback": []}[case]
    check_draft_flags(target_args("--draft-listen", listen, *flags))  # raises ValueError when refused


def test_the_opt_in_without_draft_listen_is_refused_with_the_flag_named():
    with pytest.raises(ValueError, match=f"{ANY_HOST_FLAG} apply to --draft-listen"):
        check_draft_flags(target_args(ANY_HOST_FLAG))


@pytest.mark.parametrize("listen, case, words", [
    ("127.0.0.1:7072", "nothing", ["in plaintext", "only processes on this machine"]),
    ("0.0.0.0:7072", "allow", ["only drafts from 10.0.0.0/8, 192.168.1.7"]),
    ("0.0.0.0:7072", "mutual TLS", ["over mutual TLS", "only drafts with a certificate signed by the CA in"]),
    ("0.0.0.0:7072", "TLS and opt-in", ["a certificate is not asked for", "ANY host that reaches this port",
                                         "reads every prompt and output"]),
])
def test_the_start_up_log_says_who_may_join_and_over_what(pki, listen, case, words):
    flags = {"nothing": [], "allow": ["--draft-allow", "10.0.0.0/8", "--draft-allow", "192.168.1.7"],
             "mutual TLS": tls_flags(pki, ca=True), "TLS and opt-in": [*tls_flags(pki, ca=False), ANY_HOST_FLAG]}[case]
    said = who_may_join(target_args("--draft-listen", listen, *flags))
    assert all(word in said for word in words), said


def test_a_target_open_to_any_host_warns_at_start_who_may_join(tiny_target, process_logs):
    pool_port = free_port()
    target = start("duo.cli.target", ["--model", str(tiny_target), "--draft-listen", f"0.0.0.0:{pool_port}",
                                      ANY_HOST_FLAG], process_logs)
    try:
        until(lambda: "listening for drafts that join" in target.log(), target)
        line = next(line for line in target.log().splitlines() if "listening for drafts that join" in line)
        assert " WARNING " in line and "ANY host that reaches this port" in line, line
    finally:
        target.stop()


def test_an_ipv6_draft_is_judged_by_its_address_as_grpc_writes_it():
    assert peer_host("ipv6:%5B::1%5D:5000") == "::1"  # grpc 1.5x+ writes the brackets percent-encoded
    assert allowed("ipv6:%5B::1%5D:5000", parse_allow(["::1"]))
    assert allowed("ipv6:%5Bfd00::7%5D:5000", parse_allow(["fd00::/8"]))
    assert not allowed("ipv6:%5Bfe80::7%5D:5000", parse_allow(["fd00::/8"]))


class Pool:
    """What PoolService needs of the target's DraftPool: joined drafts added, and removed when their call ends."""

    def __init__(self) -> None:
        self.drafts: list[DraftConnection] = []

    def add(self, draft: DraftConnection) -> None:
        self.drafts.append(draft)

    async def remove(self, draft: DraftConnection) -> None:
        self.drafts.remove(draft)


async def serve_pool(vocab) -> tuple[grpc.aio.Server, Pool, str]:
    """The pool's port as duo-target --draft-listen serves it, on a free loopback port."""
    pool = Pool()
    server = pool_server()
    pb_grpc.add_PoolServicer_to_server(PoolService(pool, "tiny-target", vocab, max_lead=16), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, pool, f"127.0.0.1:{port}"


def hello(vocab, model: str = "tiny-draft") -> pb.JoinUp:
    return pb.JoinUp(hello=pb.Hello(protocol=wire.PROTOCOL, model=model, vocab=wire.vocab_to_pb(vocab)))


async def join(channel: grpc.aio.Channel, message: pb.JoinUp) -> pb.JoinDown:
    """Send `message` first on a Join call and read the target's first answer (AioRpcError when it refuses)."""
    call = pb_grpc.PoolStub(channel).Join()
    try:
        await call.write(message)
    except asyncio.InvalidStateError:  # the call ended while the message was written: read says how
        pass
    return await asyncio.wait_for(call.read(), 30)


def test_the_pool_port_reads_a_hello_of_qwens_vocabulary_and_refuses_a_message_larger_than_its_bound(target_model):
    vocab = target_model.vocab()
    honest = hello(vocab)
    assert vocab.n_vocab > 150_000 and 4 * honest.ByteSize() < MAX_JOIN_MESSAGE_BYTES  # room to spare
    oversized = hello(vocab, model="x" * MAX_JOIN_MESSAGE_BYTES)

    async def run() -> None:
        server, pool, address = await serve_pool(vocab)
        try:
            async with grpc.aio.insecure_channel(address, options=grpc_channel_options()) as channel:
                reply = await join(channel, honest)
                assert reply.WhichOneof("message") == "hello"
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await join(channel, oversized)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await server.stop(0)

    asyncio.run(run())


def test_the_pool_port_refuses_calls_beyond_its_bound(target_model, monkeypatch):
    monkeypatch.setattr(joined, "MAX_JOIN_CALLS", 2)
    vocab = target_model.vocab()

    async def run() -> None:
        server, pool, address = await serve_pool(vocab)
        try:
            async with grpc.aio.insecure_channel(address, options=grpc_channel_options()) as channel:
                stub = pb_grpc.PoolStub(channel)
                joined_calls = [stub.Join() for _ in range(2)]
                for call in joined_calls:  # two drafts join, and stay
                    await call.write(hello(vocab))
                    assert (await asyncio.wait_for(call.read(), 30)).WhichOneof("message") == "hello"
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await asyncio.wait_for(stub.Join().read(), 30)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert len(pool.drafts) == 2
                for call in joined_calls:
                    call.cancel()
        finally:
            await server.stop(0)

    asyncio.run(run())


def test_a_draft_the_full_pool_port_refuses_says_the_target_takes_no_more_and_stays_up(target_model, draft_model,
                                                                                        monkeypatch):
    monkeypatch.setattr(joined, "MAX_JOIN_CALLS", 1)
    vocab = target_model.vocab()

    async def run() -> None:
        server, _, address = await serve_pool(vocab)
        metrics = DraftMetrics()
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=64, top_k_cap=10, observer=metrics, max_sessions=2)
        servicer = DraftServicer(drafter, SessionLimits(total=2, per_target=2), metrics)
        async with grpc.aio.insecure_channel(address, options=grpc_channel_options()) as channel:
            first = pb_grpc.PoolStub(channel).Join()
            await first.write(hello(vocab))
            await asyncio.wait_for(first.read(), 30)  # the port's one call is taken
            joiner = Joiner(servicer, address)
            joining = asyncio.create_task(joiner.run())
            try:
                await until_async(lambda: joiner.state == "refused")
                assert "takes no more drafts" in joiner.last_error, joiner.last_error
            finally:
                servicer.stop()
                joining.cancel()
                await asyncio.gather(joining, return_exceptions=True)
                first.cancel()
                await server.stop(0)
                await drafter.stop()

    asyncio.run(run())


def test_a_joined_drafts_model_name_is_kept_clipped_and_printable(target_model):
    vocab = target_model.vocab()

    async def run() -> None:
        server, pool, address = await serve_pool(vocab)
        try:
            async with grpc.aio.insecure_channel(address, options=grpc_channel_options()) as channel:
                call = pb_grpc.PoolStub(channel).Join()
                await call.write(hello(vocab, model=HOSTILE_NAME))
                assert (await asyncio.wait_for(call.read(), 30)).WhichOneof("message") == "hello"
                await until_async(lambda: bool(pool.drafts))
                assert_kept_clipped(pool.drafts[0].draft_model)
                call.cancel()
        finally:
            await server.stop(0)

    asyncio.run(run())


class HostileDraft(pb_grpc.DraftServicer):
    """A draft that a target dials (--peer) and that names itself with HOSTILE_NAME."""

    def __init__(self, vocab) -> None:
        self.hello = pb.Hello(protocol=wire.PROTOCOL, model=HOSTILE_NAME, vocab=wire.vocab_to_pb(vocab))

    async def Handshake(self, request: pb.Hello, context: grpc.aio.ServicerContext) -> pb.Hello:
        return self.hello

    async def Speculate(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        async for _ in request_iterator:  # drafts nothing; the stream stays up while the target's does
            pass


def test_a_dialed_drafts_model_name_is_kept_clipped_and_printable(target_model):
    vocab = target_model.vocab()

    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_DraftServicer_to_server(HostileDraft(vocab), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        link = DraftLink(f"127.0.0.1:{port}", "tiny-target", vocab, max_lead=16)
        running = asyncio.create_task(link.run())
        try:
            await until_async(lambda: link.connected)
            assert_kept_clipped(link.draft_model)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await server.stop(0)

    asyncio.run(run())


def assert_kept_clipped(name: str) -> None:
    assert name.startswith("evil?2025-01-01 duo.target INFO") and name.isprintable()
    assert len(name) <= MAX_MODEL_NAME_CHARS + len("...")


@pytest.mark.parametrize("flags, listen", [
    ([], draft_process.DEFAULT_LISTEN),
    (["--join", "10.0.0.1:7072"], None),
    (["--join", "10.0.0.1:7072", "--listen", "0.0.0.0:7090"], "0.0.0.0:7090"),
])
def test_a_draft_listens_on_its_default_unless_it_only_joins_and_where_it_is_told(flags, listen):
    assert draft_process.listen_address(draft_process.build_parser().parse_args(flags)) == listen


def test_tls_for_a_port_a_joining_draft_does_not_open_is_refused_with_the_flags_named(tmp_path, capsys, pki):
    code = draft_process.main(["--model", str(tmp_path / "never-loaded.gguf"), "--join", "10.0.0.1:7072",
                               "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)])
    assert code == 1
    assert "give --listen too" in capsys.readouterr().err


def test_two_drafts_that_only_join_run_on_one_machine_and_both_join_their_target(tiny_target, tiny_draft,
                                                                                 process_logs):
    pool_port = free_port()
    target = start("duo.cli.target", ["--model", str(tiny_target), "--draft-listen", f"127.0.0.1:{pool_port}"],
                   process_logs)
    drafts = [start_joining_draft(tiny_draft, f"127.0.0.1:{pool_port}", process_logs) for _ in range(2)]
    try:
        until(lambda: target.log().count("(joined) joined the pool") == 2, target, *drafts)
        for draft in drafts:
            assert "no port of its own" in draft.log() and draft.popen.poll() is None, draft.log()
    finally:
        for process in (*drafts, target):
            process.stop()


def start_joining_draft(model: Path, target: str, log_dir: Path) -> Process:
    """`duo-draft --join target` without --listen (processes.start always gives one)."""
    log_path = log_dir / f"joining-draft-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen([sys.executable, "-m", "duo.cli.draft", "--model", str(model), "--join", target,
                                  "--threads", "1"], stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Process(popen, "", log_path)
