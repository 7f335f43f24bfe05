"""The target's connection to duo-draft: handshake, one multiplexed stream, reconnection with backoff."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import AsyncIterator, Protocol

import grpc

from duo import wire
from duo._proto import duo_pb2 as pb
from duo._proto import duo_pb2_grpc as pb_grpc
from duo.model import IncompatibleVocab, Vocab, check_compatible
from duo.runtime import grpc_channel_options

log = logging.getLogger("duo.link")

HANDSHAKE_TIMEOUT_S = 30.0
BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 2.0


class LinkedSession(Protocol):
    """What the link needs from a target session."""

    session_id: int

    def open_message(self) -> pb.OpenSession: ...
    def on_chunk(self, chunk: pb.DraftChunk) -> None: ...
    def on_draft_lost(self) -> None: ...


class DraftLink:
    """Keeps duo-target connected to one duo-draft, whatever the draft does.

    Sessions register here; while a stream is up, their events go out on it and the draft's chunks
    come back to them. When the draft dies or stalls out, sessions are told and go on decoding alone;
    when it comes back, every registered session is re-opened with its committed tokens so far, so
    speculation resumes even in the middle of a generation.
    """

    def __init__(self, address: str, model_name: str, vocab: Vocab,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.address = address
        self.model_name = model_name
        self.vocab = vocab
        self.credentials = credentials
        self.sessions: dict[int, LinkedSession] = {}
        self.state = "disconnected"  # or "connected", "incompatible"
        self.last_error = ""
        self.connections = 0
        self._outbox: asyncio.Queue[pb.TargetEvent] | None = None
        # Built once: it carries the whole vocabulary, and an absent draft is retried every few seconds.
        self._hello = pb.Hello(protocol=wire.PROTOCOL, model=model_name, vocab=wire.vocab_to_pb(vocab))

    @property
    def connected(self) -> bool:
        return self.state == "connected"

    def register(self, session: LinkedSession) -> None:
        self.sessions[session.session_id] = session
        log.debug("session %d registered (outbox %s)", session.session_id, self._outbox is not None)
        self.send(pb.TargetEvent(open=session.open_message()))

    def unregister(self, session_id: int) -> None:
        if self.sessions.pop(session_id, None) is not None:
            self.send(pb.TargetEvent(close=pb.CloseSession(session_id=session_id)))

    def send(self, event: pb.TargetEvent) -> None:
        """Queue an event for the draft; dropped while no draft is connected (sessions re-open on reconnect)."""
        if self._outbox is not None:
            self._outbox.put_nowait(event)

    async def run(self) -> None:
        """Connect, serve, and reconnect forever (until cancelled)."""
        backoff = BACKOFF_FIRST_S
        while True:
            started = asyncio.get_running_loop().time()
            await self._connect_once()
            if asyncio.get_running_loop().time() - started > 10 * BACKOFF_MAX_S:
                backoff = BACKOFF_FIRST_S  # it was up for a while: retry quickly
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(BACKOFF_MAX_S, backoff * 2)

    async def _connect_once(self) -> None:
        options = grpc_channel_options()
        channel = (grpc.aio.secure_channel(self.address, self.credentials, options=options)
                   if self.credentials else grpc.aio.insecure_channel(self.address, options=options))
        try:
            stub = pb_grpc.DraftStub(channel)
            await self._handshake(stub)
            await self._stream(stub)
        except grpc.aio.AioRpcError as error:
            self._lost(f"{error.code().name}: {error.details()}", error.code())
        except IncompatibleVocab as error:
            self._lost(str(error), grpc.StatusCode.FAILED_PRECONDITION)
        finally:
            await channel.close()

    async def _handshake(self, stub: pb_grpc.DraftStub) -> None:
        reply = await stub.Handshake(self._hello, timeout=HANDSHAKE_TIMEOUT_S, wait_for_ready=False,
                                     compression=grpc.Compression.Gzip)
        check_compatible(self.vocab, wire.vocab_from_pb(reply.vocab))

    async def _stream(self, stub: pb_grpc.DraftStub) -> None:
        outbox: asyncio.Queue[pb.TargetEvent] = asyncio.Queue()
        for session in self.sessions.values():
            outbox.put_nowait(pb.TargetEvent(open=session.open_message()))
        self._outbox = outbox
        self.state, self.last_error = "connected", ""
        self.connections += 1
        log.info("draft %s connected; speculating for %d running session(s)", self.address, len(self.sessions))
        try:
            async for event in stub.Speculate(_drain(outbox)):
                kind = event.WhichOneof("event")
                session = self.sessions.get(event.chunk.session_id if kind == "chunk" else event.error.session_id)
                if session is None:
                    continue
                if kind == "chunk":
                    try:
                        session.on_chunk(event.chunk)
                    except ValueError as error:  # the chain then has a gap and waits for a new epoch
                        log.warning("dropped a malformed chunk for session %d: %s", session.session_id, error)
                else:
                    log.warning("draft refused session %d: %s", event.error.session_id, event.error.message)
        finally:
            self._outbox = None
            for session in self.sessions.values():
                session.on_draft_lost()
        self._lost("the draft closed the stream", None)

    def _lost(self, reason: str, code: grpc.StatusCode | None) -> None:
        was = self.state
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            self.state = "incompatible"
            log.error("draft %s refused this target: %s", self.address, reason)
        else:
            self.state = "disconnected"
            if was == "connected":
                log.warning("draft %s lost (%s); decoding alone until it is back", self.address, reason)
        self.last_error = reason


async def _drain(outbox: asyncio.Queue[pb.TargetEvent]) -> AsyncIterator[pb.TargetEvent]:
    while True:
        yield await outbox.get()


def incompatible_error(link: DraftLink) -> str:
    return f"the draft at {link.address} is incompatible with this target: {link.last_error}"

