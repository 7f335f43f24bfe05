"""duo-draft --join: a draft dials its target (service Pool), drafts over that stream exactly as over Speculate,
refuses a target it cannot draft for, survives targets that refuse it or go away, and joins over TLS."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path

import grpc
import pytest

from duo.net import wire
from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.cli.draft import main
from duo.draft import joining
from duo.draft.drafter import Drafter
from duo.draft.joining import Joiner
from duo.draft.metrics import DraftMetrics
from duo.draft.service import DraftServicer, SessionLimits
from duo.llama.worker import ModelWorker
from duo.net.tls import server_credentials
from helpers.pki import write_pki
from helpers.processes import Process, accepts, free_port, start
from helpers.tiny_models import MISMATCH_TOKEN_ID, MISMATCH_TOKEN_TEXT
from helpers.waiting import until_async

PROMPT = [9707, 11, 1879]
AHEAD = 4  # the chain tokens a session asks for


class FakeTarget(pb_grpc.PoolServicer):
    """duo-target's Pool as a joining draft sees it: answers the draft's Hello with `hello` (or fails the call with
    `refusal`, a status and its details), then sends what is put in `outbox` and collects the draft's events."""

    def __init__(self, hello: pb.Hello, refusal: tuple[grpc.StatusCode, str] | None = None) -> None:
        self.hello = hello
        self.refusal = refusal
        self.drafts: list[pb.Hello] = []  # the Hello of every Join call
        self.streams = 0  # calls that got past the Hellos
        self.events: list[pb.DraftEvent] = []
        self.outbox: asyncio.Queue[pb.TargetEvent] = asyncio.Queue()

    async def Join(self, request_iterator: AsyncIterable[pb.JoinUp],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.JoinDown]:
        first = await request_iterator.__anext__()
        self.drafts.append(first.hello)
        if self.refusal is not None:
            await context.abort(*self.refusal)
        yield pb.JoinDown(hello=self.hello)
        self.streams += 1
        reader = asyncio.create_task(self._collect(request_iterator))
        try:
            while True:
                yield pb.JoinDown(event=await self.outbox.get())
        finally:
            reader.cancel()

    async def _collect(self, request_iterator: AsyncIterable[pb.JoinUp]) -> None:
        async for up in request_iterator:
            self.events.append(up.event)

    def open(self, session_id: int) -> None:
        self.outbox.put_nowait(pb.TargetEvent(open=pb.OpenSession(session_id=session_id, committed=PROMPT,
                                                                  max_ahead=AHEAD)))

    def chain(self, session_id: int) -> list[int]:
        return chain_of(self.events, session_id)


def chain_of(events: list[pb.DraftEvent], session_id: int) -> list[int]:
    """The tokens of a session's first chain (epoch 0, no branch) drafted so far, from the end of PROMPT on."""
    tokens: dict[int, int] = {}
    for event in events:
        chunk = event.chunk
        if event.WhichOneof("event") == "chunk" and chunk.session_id == session_id and chunk.epoch == 0:
            tokens.update(zip(range(chunk.start, chunk.start + len(chunk.tokens)), chunk.tokens))
    return [tokens[position] for position in range(len(PROMPT), len(PROMPT) + len(tokens)) if position in tokens]


async def serve_fake(target: FakeTarget, port: int, credentials: grpc.ServerCredentials | None = None
                     ) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_PoolServicer_to_server(target, server)
    address = f"127.0.0.1:{port}"
    server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    await server.start()
    return server


async def start_draft(tiny_draft: Path, logs: Path, *flags: str) -> Process:
    return await asyncio.to_thread(start, "duo.cli.draft", ["--model", str(tiny_draft), *flags], logs)


def target_hello(target_model) -> pb.Hello:
    return pb.Hello(protocol=wire.PROTOCOL, model="tiny-target", vocab=wire.vocab_to_pb(target_model.vocab()))


async def chain_over_speculate(draft: Process, hello: pb.Hello) -> list[int]:
    """What the draft drafts for PROMPT when a target dials it (Handshake, then Speculate)."""
    async with grpc.aio.insecure_channel(draft.address) as channel:
        stub = pb_grpc.DraftStub(channel)
        await stub.Handshake(hello, timeout=10)
        call = stub.Speculate()
        await call.write(pb.TargetEvent(open=pb.OpenSession(session_id=1, committed=PROMPT, max_ahead=AHEAD)))
        events: list[pb.DraftEvent] = []
        while len(chain_of(events, 1)) < AHEAD:
            event = await asyncio.wait_for(call.read(), 15)
            assert event is not grpc.aio.EOF, "the draft ended the Speculate stream"
            events.append(event)
        call.cancel()
    return chain_of(events, 1)[:AHEAD]


def test_a_draft_started_with_join_dials_the_target_and_drafts_what_it_drafts_over_speculate(
        tiny_draft, target_model, process_logs):
    async def run() -> None:
        port = free_port()
        target = FakeTarget(target_hello(target_model))
        server = await serve_fake(target, port)
        draft = await start_draft(tiny_draft, process_logs, "--join", f"127.0.0.1:{port}")
        try:
            await until_async(lambda: target.streams == 1, draft, what="the draft to join")
            assert target.drafts[0].protocol == wire.PROTOCOL and target.drafts[0].vocab.token_texts
            target.open(7)
            await until_async(lambda: len(target.chain(7)) >= AHEAD, draft, what="a chain over the joined stream")
            target.outbox.put_nowait(pb.TargetEvent(close=pb.CloseSession(session_id=7)))
            assert target.chain(7)[:AHEAD] == await chain_over_speculate(draft, target_hello(target_model))
            assert f"joined target 127.0.0.1:{port} (model tiny-target)" in draft.log()
        finally:
            draft.stop()
            await server.stop(0)
        assert draft.popen.returncode == 0, draft.log()

    asyncio.run(run())


def mismatched(hello: pb.Hello) -> pb.Hello:
    """`hello` with one token's text changed: a target of another tokenizer."""
    other = pb.Hello()
    other.CopyFrom(hello)
    other.vocab.token_texts[MISMATCH_TOKEN_ID] = MISMATCH_TOKEN_TEXT.encode()
    return other


@pytest.mark.parametrize("case, words", [
    ("another vocabulary", [f"token {MISMATCH_TOKEN_ID} differs", "this draft refused it"]),
    ("FAILED_PRECONDITION", ["it refused this draft", "the target's own reason"]),
    ("PERMISSION_DENIED", ["does not allow this draft's address", "not on the list"]),
])
def test_a_target_the_draft_cannot_draft_for_is_logged_as_an_error_and_the_draft_stays_up(
        tiny_draft, target_model, process_logs, case, words):
    hello = target_hello(target_model)
    target = {"another vocabulary": lambda: FakeTarget(mismatched(hello)),
              "FAILED_PRECONDITION": lambda: FakeTarget(hello, (grpc.StatusCode.FAILED_PRECONDITION,
                                                                "the target's own reason")),
              "PERMISSION_DENIED": lambda: FakeTarget(hello, (grpc.StatusCode.PERMISSION_DENIED, "not on the list")),
              }[case]()

    async def run() -> None:
        port = free_port()
        server = await serve_fake(target, port)
        draft = await start_draft(tiny_draft, process_logs, "--join", f"127.0.0.1:{port}")
        try:
            await until_async(lambda: all(word in draft.log() for word in words), draft, what="the refusal in the log")
            assert f"ERROR cannot draft for target 127.0.0.1:{port}" in draft.log()
            assert target.streams == 0 or not target.events  # the draft drafts nothing for it
            assert draft.popen.poll() is None and accepts(int(draft.address.rpartition(":")[2]))
        finally:
            draft.stop()
            await server.stop(0)

    asyncio.run(run())


def test_a_draft_asks_a_target_that_refused_it_again_and_joins_once_it_accepts(draft_model, target_model,
                                                                                monkeypatch, caplog):
    monkeypatch.setattr(joining, "REFUSED_RETRY_S", 0.05)
    target = FakeTarget(target_hello(target_model), (grpc.StatusCode.FAILED_PRECONDITION, "wrong model"))

    async def run() -> None:
        metrics = DraftMetrics()
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=64, top_k_cap=10, observer=metrics, max_sessions=4)
        servicer = DraftServicer(drafter, SessionLimits(total=4, per_target=4), metrics)
        port = free_port()
        server = await serve_fake(target, port)
        joiner = Joiner(servicer, f"127.0.0.1:{port}")
        task = asyncio.create_task(joiner.run())
        try:
            await until_async(lambda: len(target.drafts) >= 3, what="the draft to ask three times")
            target.refusal = None
            await until_async(lambda: joiner.state == "joined", what="the draft to join")
            target.open(1)
            await until_async(lambda: len(target.chain(1)) >= AHEAD, what="a chain once joined")
        finally:
            servicer.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(0)
        try:
            assert task.cancelled()  # it ended on the cancellation, not on an error of its own
            assert not servicer.connections and await holds_no_slot(drafter)  # the stop freed the joined session
        finally:
            await drafter.stop()

    with caplog.at_level(logging.INFO, logger="duo.draft"):
        asyncio.run(run())
    refusals = [r for r in caplog.records if r.levelno == logging.ERROR and "wrong model" in r.getMessage()]
    assert len(refusals) == 1, caplog.text  # the same refusal is logged once, however often it is asked again


async def holds_no_slot(drafter: Drafter) -> bool:
    await drafter.worker.run(time.sleep, 0)  # what the model thread had queued (closes) has run
    return drafter.slots_free == drafter.max_sessions


def test_a_joined_draft_joins_again_when_its_target_comes_back_on_the_same_port(tiny_draft, target_model,
                                                                              process_logs):
    async def run() -> None:
        port = free_port()
        first = FakeTarget(target_hello(target_model))
        server = await serve_fake(first, port)
        draft = await start_draft(tiny_draft, process_logs, "--join", f"127.0.0.1:{port}")
        try:
            first.open(1)
            await until_async(lambda: len(first.chain(1)) >= AHEAD, draft, what="a chain from the first target")
            await server.stop(0)
            await until_async(lambda: "lost target" in draft.log(), draft, what="the draft to see its target go")
            await until_async(lambda: f"cannot join target 127.0.0.1:{port}" in draft.log(), draft, what="a join that fails")
            second = FakeTarget(target_hello(target_model))
            server = await serve_fake(second, port)
            second.open(1)
            await until_async(lambda: len(second.chain(1)) >= AHEAD, draft, what="a chain from the target back")
            assert draft.log().count(f"joined target 127.0.0.1:{port}") == 2
        finally:
            draft.stop()
            await server.stop(0)

    asyncio.run(run())


def test_a_draft_joins_over_mutual_tls(tiny_draft, target_model, process_logs, tmp_path):
    pki = write_pki(tmp_path)

    async def run() -> None:
        port = free_port()
        target = FakeTarget(target_hello(target_model))
        credentials = server_credentials(str(pki.server_cert), str(pki.server_key), str(pki.ca))  # client certs
        server = await serve_fake(target, port, credentials)
        draft = await start_draft(tiny_draft, process_logs, "--join", f"127.0.0.1:{port}",
                                  "--join-tls-ca", str(pki.ca), "--join-tls-cert", str(pki.client_cert),
                                  "--join-tls-key", str(pki.client_key))
        try:
            target.open(1)
            await until_async(lambda: len(target.chain(1)) >= AHEAD, draft, what="a chain over TLS")
            assert "over TLS" in draft.log()
        finally:
            draft.stop()
            await server.stop(0)

    asyncio.run(run())


@pytest.mark.parametrize("flags, words", [
    (["--join", "http://10.0.0.1:7071"], ["--join takes HOST:PORT without a scheme"]),
    (["--join", "10.0.0.1"], ["--join", "not HOST:PORT"]),
    (["--join", "10.0.0.1:7071", "--join-tls-cert", "c.pem"], ["give both the certificate and its key"]),
    (["--join-tls-ca", "ca.pem"], ["--join-tls-ca secures --join"]),
    (["--join", "10.0.0.1:7071", "--join-tls-ca", "missing.pem"], ["--join-tls-ca missing.pem"]),
])
def test_bad_join_flags_are_refused_before_the_model_loads(tmp_path, capsys, flags, words):
    assert main(["--model", str(tmp_path / "never-loaded.gguf"), "--listen", "127.0.0.1:0", *flags]) == 1
    error = capsys.readouterr().err
    assert all(word in error for word in words), error
