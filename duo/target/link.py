"""The target's connection to duo-draft: handshake, one multiplexed stream, reconnection with backoff."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Protocol

import grpc

from duo import wire
from duo._proto import duo_pb2 as pb
from duo._proto import duo_pb2_grpc as pb_grpc
from duo.vocab import IncompatibleVocab, Vocab, check_compatible
from duo.runtime import MAX_MESSAGE_BYTES, grpc_channel_options, within
from duo.target.chain import DraftChain
from duo.wire import ChainChunk

log = logging.getLogger("duo.link")

# A stopped or overloaded draft accepts the connection but never answers: give up on the handshake
# (a vocabulary of a few MB each way) after this long and try again.
HANDSHAKE_TIMEOUT_S = 30.0
BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 2.0
# A draft that refused this target (the wrong model) is asked again this often, since it may be
# swapped for the right one; meanwhile the target decodes alone.
INCOMPATIBLE_RETRY_S = 30.0
# How far beyond the lead last told to the draft (max_ahead) a chain may reach: a Steer that
# shortened the lead crosses chunks drafted under the longer one (the adaptive policy's lead is at
# most 2 x 16 + 2), and anything further is a broken or hostile draft.
LEAD_MARGIN = 64
# Longest text of the draft's own that is logged (its error messages are untrusted too).
MAX_LOGGED_CHARS = 200
# A draft that answers pings but reads none of the stream fills the HTTP/2 window, and the target's
# events would pile up in memory for as long as it stays: one write blocked this long drops the stream
# (the link reconnects; the outbox holds at most what the target sends meanwhile).
WRITE_STALL_S = 30.0
# While the draft cannot be reached, the target says so at its first failure, then this often.
UNREACHABLE_LOG_EVERY_S = 60.0
UNREACHABLE_HINT = ("is duo-draft running there, listening on an address this machine can reach (it listens on "
                    "127.0.0.1 unless started with --listen 0.0.0.0:PORT), with the port open in the firewall?")


class DraftStalled(Exception):
    """The draft stopped reading the target's events."""


class LinkedSession(Protocol):
    """What the link needs from a target session."""

    session_id: int
    committed: list[int]
    chain: DraftChain
    max_ahead: int  # as last told to the draft

    def open_message(self) -> pb.OpenSession: ...
    def on_chunk(self, chunk: ChainChunk) -> None: ...
    def on_draft_lost(self) -> None: ...
    def on_draft_refused(self) -> None: ...


class DraftObserver(Protocol):
    """Something that watches what the link refuses from the draft (metrics)."""

    def on_draft_rejected(self, reason: str, entries: int) -> None: ...


class DraftLink:
    """Keeps duo-target connected to one duo-draft, whatever the draft does.

    Sessions register here; while a stream is up, their events go out on it and the draft's chunks
    come back to them, checked first: a chunk is cut at its first entry that breaks a bound. When
    the draft dies, stalls out or is incompatible, sessions go on decoding alone; when it comes back,
    every registered session is re-opened with its committed tokens so far, so speculation resumes
    even in the middle of a generation. Nothing the draft does ends the link.
    """

    def __init__(self, address: str, model_name: str, vocab: Vocab,
                 credentials: grpc.ChannelCredentials | None = None, *, max_lead: int) -> None:
        self.address = address
        # The largest event an honest draft sends: a chunk of the longest lead the target allows, plus the margin.
        self.max_event_bytes = min(MAX_MESSAGE_BYTES, wire.max_chunk_bytes(max_lead + LEAD_MARGIN))
        self.model_name = model_name
        self.vocab = vocab
        self.credentials = credentials
        self.sessions: dict[int, LinkedSession] = {}
        self.observers: list[DraftObserver] = []
        self.state = "disconnected"  # or "connected", "incompatible"
        self.last_error = ""
        self.connections = 0
        self._draft_model = ""  # as the draft named it in the handshake
        self._outbox: asyncio.Queue[pb.TargetEvent] | None = None
        self._faulted: set[int] = set()  # sessions whose draft faults were logged already
        self._failing_since: float | None = None  # first failure to reach the draft since it was last up
        self._failure_logged_at = 0.0
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
        self._faulted.discard(session_id)
        if self.sessions.pop(session_id, None) is not None:
            self.send(pb.TargetEvent(close=pb.CloseSession(session_id=session_id)))

    def send(self, event: pb.TargetEvent) -> None:
        """Queue an event for the draft; dropped while no draft is connected (sessions re-open on reconnect)."""
        if self._outbox is not None:
            self._outbox.put_nowait(event)

    async def run(self) -> None:
        """Connect, serve, and reconnect forever (until cancelled); never raises otherwise."""
        backoff = BACKOFF_FIRST_S
        while True:
            started = asyncio.get_running_loop().time()
            try:
                await self._connect_once()
            except Exception as error:  # a bug here must cost speculation, not the target process
                log.exception("the link to draft %s failed; reconnecting", self.address)
                self._lost(f"internal error: {error!r}")
            if asyncio.get_running_loop().time() - started > 10 * BACKOFF_MAX_S:
                backoff = BACKOFF_FIRST_S  # it was up for a while: retry quickly
            delay = INCOMPATIBLE_RETRY_S if self.state == "incompatible" else backoff * (0.5 + random.random())
            await asyncio.sleep(delay)
            backoff = min(BACKOFF_MAX_S, backoff * 2)

    async def _connect_once(self) -> None:
        try:
            # The handshake carries both vocabularies (megabytes); the stream only what an honest draft
            # sends, so that a larger message is refused before it is read (a 64 MiB one would be parsed
            # whole first): each has a channel of its own, with its own receive limit.
            async with self._channel(MAX_MESSAGE_BYTES) as channel:
                if not await self._handshake(pb_grpc.DraftStub(channel)):
                    return
            async with self._channel(self.max_event_bytes) as channel:
                await self._stream(pb_grpc.DraftStub(channel))
        except grpc.aio.AioRpcError as error:
            self._lost(f"{error.code().name}: {_clip(error.details() or '')}")

    def _channel(self, max_receive_bytes: int) -> grpc.aio.Channel:
        options = grpc_channel_options(max_receive_bytes)
        return (grpc.aio.secure_channel(self.address, self.credentials, options=options)
                if self.credentials else grpc.aio.insecure_channel(self.address, options=options))

    async def _handshake(self, stub: pb_grpc.DraftStub) -> bool:
        """Exchange vocabularies; False (and the state "incompatible") when either side refuses the pair."""
        try:
            reply = await stub.Handshake(self._hello, timeout=HANDSHAKE_TIMEOUT_S, wait_for_ready=False,
                                         compression=grpc.Compression.Gzip)
            if reply.protocol != wire.PROTOCOL:
                raise IncompatibleVocab(f"the draft speaks protocol {_clip(reply.protocol)!r}, not {wire.PROTOCOL!r}: "
                                        "run the same duo version on both sides")
            check_compatible(self.vocab, wire.vocab_from_pb(reply.vocab))
            self._draft_model = reply.model or "unnamed"
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            self._refused(_clip(error.details() or "the draft refused this target"))
            return False
        except IncompatibleVocab as error:
            self._refused(str(error))
            return False
        return True

    async def _stream(self, stub: pb_grpc.DraftStub) -> None:
        outbox: asyncio.Queue[pb.TargetEvent] = asyncio.Queue()
        for session in self.sessions.values():
            outbox.put_nowait(pb.TargetEvent(open=session.open_message()))
        self._outbox = outbox
        self.state, self.last_error = "connected", ""
        self.connections += 1
        self._failing_since = None
        log.info("draft %s connected (model %s, protocol %s); speculating for %d running session(s)", self.address,
                 _clip(self._draft_model), wire.PROTOCOL, len(self.sessions))
        call = stub.Speculate()
        # grpc leaves a request iterator of its own pending forever after a failed call, so the link
        # writes its events itself, and the stream lasts until reading or writing ends.
        sending = asyncio.create_task(_send_all(call, outbox))
        reading = asyncio.create_task(self._read_all(call))
        reason = "the draft closed the stream"
        try:
            done, _ = await asyncio.wait({sending, reading}, return_when=asyncio.FIRST_COMPLETED)
            if reading in done and reading.cancelled():
                # Nothing here cancelled the reader: grpc did. A write that timed out cancels the whole
                # call, and grpc tells the reader so with asyncio.CancelledError (its task then counts as
                # cancelled); left to propagate, that would end the link's reconnect loop for good. The
                # writer says why, at once.
                await asyncio.wait({sending}, timeout=WRITE_STALL_S)
                reason = str(sending.exception()) if _stalled(sending) else "the stream was cancelled"
            elif reading in done:
                reading.result()  # the call's error, if any, is handled by _connect_once
            elif _stalled(sending):
                reason = str(sending.exception())
            else:
                sending.result()
        finally:
            self._outbox = None
            for task in (sending, reading):
                task.cancel()
            call.cancel()
            await asyncio.gather(sending, reading, return_exceptions=True)
            for session in self.sessions.values():
                session.on_draft_lost()
        self._lost(reason)

    async def _read_all(self, call: grpc.aio.StreamStreamCall) -> None:
        async for event in call:
            self._on_event(event)

    def _on_event(self, event: pb.DraftEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "chunk":
            session = self.sessions.get(event.chunk.session_id)
            if session is not None:  # else a session that ended meanwhile
                self._on_chunk(session, event.chunk)
        elif kind == "error" and event.error.session_id in self.sessions:
            self.sessions[event.error.session_id].on_draft_refused()
            self._fault(event.error.session_id, f"refused it: {_clip(event.error.message)}")

    def _on_chunk(self, session: LinkedSession, message: pb.DraftChunk) -> None:
        n_committed = len(session.committed)
        bounds = wire.ChunkBounds(n_vocab=self.vocab.n_vocab, n_committed=n_committed,
                                  epoch=session.chain.newest_epoch,
                                  max_end=n_committed + session.max_ahead + LEAD_MARGIN,
                                  live=session.chain.live_epochs)
        chunk, rejection = wire.chunk_from_pb(message, bounds)
        if rejection is not None:
            for observer in self.observers:
                observer.on_draft_rejected(rejection.reason, rejection.entries)
            self._fault(session.session_id, f"sent {rejection.detail} ({rejection.reason}); "
                                            f"dropped {rejection.entries} chain entries")
        if chunk.tokens or chunk.paused:
            session.on_chunk(chunk)

    def _fault(self, session_id: int, what: str) -> None:
        """Log a draft's misbehaviour once per session: a faulty draft sends many chunks."""
        if session_id not in self._faulted:
            self._faulted.add(session_id)
            log.warning("draft %s, session %d: %s; further faults of this session are not logged",
                        self.address, session_id, what)

    def _refused(self, reason: str) -> None:
        reason = _clip(reason)  # it quotes the draft's own texts, into the log and /health
        if self.state != "incompatible" or reason != self.last_error:
            log.error("draft %s is incompatible with this target, decoding alone (asking again every %.0f s): %s",
                      self.address, INCOMPATIBLE_RETRY_S, reason)
        self.state, self.last_error = "incompatible", reason

    def _lost(self, reason: str) -> None:
        reason = _clip(reason)
        if self.state == "connected":
            log.warning("draft %s lost (%s); decoding alone until it is back", self.address, reason)
        else:
            self._unreachable(reason)
        self.state, self.last_error = "disconnected", reason

    def _unreachable(self, reason: str) -> None:
        """Say that the draft cannot be reached, with the likely cause: at once, then every
        UNREACHABLE_LOG_EVERY_S while it lasts (a newcomer's draft on loopback is never reached)."""
        now = asyncio.get_running_loop().time()
        if self._failing_since is None:
            self._failing_since = now
        elif now - self._failure_logged_at < UNREACHABLE_LOG_EVERY_S:
            return
        self._failure_logged_at = now
        log.warning("cannot reach draft %s for %.0f s (%s); decoding alone meanwhile: %s", self.address,
                    now - self._failing_since, reason, UNREACHABLE_HINT)


async def _send_all(call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[pb.TargetEvent]) -> None:
    while True:
        event = await outbox.get()
        try:
            await within(call.write(event), WRITE_STALL_S)
        except asyncio.TimeoutError:
            raise DraftStalled(f"it read none of the stream for {WRITE_STALL_S:g} s") from None


def _stalled(task: asyncio.Task) -> bool:
    return task.done() and not task.cancelled() and isinstance(task.exception(), DraftStalled)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_LOGGED_CHARS else text[:MAX_LOGGED_CHARS] + "..."
