"""The target dialing one duo-draft (--peer): handshake, one multiplexed stream, reconnection with backoff."""

from __future__ import annotations

import asyncio
import logging

import grpc

from duo.net import wire
from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.llama.vocab import IncompatibleVocab, Vocab, check_compatible
from duo.net.options import MAX_MESSAGE_BYTES, grpc_channel_options
from duo.net.reconnect import Unreachable, keep_reconnecting
from duo.net.timeouts import within
from duo.target.pool.connection import DraftConnection, clip, draft_model_name

log = logging.getLogger("duo.link")

# A stopped or overloaded draft accepts the connection but never answers: give up on the handshake
# (a vocabulary of a few MB each way) after this long and try again.
HANDSHAKE_TIMEOUT_S = 30.0
# A draft that refused this target (the wrong model) is asked again this often, since it may be
# swapped for the right one; meanwhile the target decodes alone.
INCOMPATIBLE_RETRY_S = 30.0
# A draft that answers pings but reads none of the stream fills the HTTP/2 window, and the target's
# events would pile up in memory for as long as it stays: one write blocked this long drops the stream
# (the link reconnects; the outbox holds at most what the target sends meanwhile).
WRITE_STALL_S = 30.0
UNREACHABLE_HINT = ("is duo-draft running there, listening on an address this machine can reach (it listens on "
                    "127.0.0.1 unless started with --listen 0.0.0.0:PORT), with the port open in the firewall?")


class DraftStalled(Exception):
    """The draft stopped reading the target's events."""


class DraftLink(DraftConnection):
    """Keeps duo-target connected to one duo-draft it dials, whatever the draft does: when the draft dies,
    stalls out or is incompatible, its sessions go elsewhere or decode alone (the pool's choice); when it
    comes back, the sessions placed on it are re-opened with their committed tokens so far."""

    def __init__(self, address: str, model_name: str, vocab: Vocab,
                 credentials: grpc.ChannelCredentials | None = None, *, max_lead: int) -> None:
        super().__init__(address, vocab, max_lead=max_lead)
        self.model_name = model_name
        self.credentials = credentials
        self._out_of_reach = Unreachable()
        # Built once: it carries the whole vocabulary, and an absent draft is retried every few seconds.
        self._hello = pb.Hello(protocol=wire.PROTOCOL, model=model_name, vocab=wire.vocab_to_pb(vocab))

    async def run(self) -> None:
        """Connect, serve, and reconnect forever (until cancelled); never raises otherwise."""
        def bug(error: Exception) -> None:  # a bug here must cost speculation, not the target process
            log.error("the link to draft %s failed; reconnecting", self.address, exc_info=error)
            self._lost(f"internal error: {error!r}")

        await keep_reconnecting(self._connect_once, bug, lambda: self.state == "incompatible", INCOMPATIBLE_RETRY_S)

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
            self._lost(f"{error.code().name}: {clip(error.details() or '')}")

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
                raise IncompatibleVocab(f"the draft speaks protocol {clip(reply.protocol)!r}, not {wire.PROTOCOL!r}: "
                                        "run the same duo version on both sides")
            check_compatible(self.vocab, wire.vocab_from_pb(reply.vocab))
            self.draft_model = draft_model_name(reply.model)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            self._refused(clip(error.details() or "the draft refused this target"))
            return False
        except IncompatibleVocab as error:
            self._refused(str(error))
            return False
        return True

    async def _stream(self, stub: pb_grpc.DraftStub) -> None:
        outbox = self._stream_up()
        self._out_of_reach.reached()
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
            for task in (sending, reading):
                task.cancel()
            call.cancel()
            await asyncio.gather(sending, reading, return_exceptions=True)
            self._stream_down()
        self._lost(reason)

    async def _read_all(self, call: grpc.aio.StreamStreamCall) -> None:
        async for event in call:
            self.on_event(event)

    def _refused(self, reason: str) -> None:
        reason = clip(reason)  # it quotes the draft's own texts, into the log and /health
        if self.state != "incompatible" or reason != self.last_error:
            log.error("draft %s is incompatible with this target, asking again every %.0f s: %s",
                      self.address, INCOMPATIBLE_RETRY_S, reason)
        self._went_down("incompatible", reason)

    def _lost(self, reason: str) -> None:
        reason = clip(reason)
        if self.state == "connected":
            log.warning("draft %s lost (%s); reconnecting", self.address, reason)
        else:
            self._unreachable(reason)
        self._went_down("disconnected", reason)

    def _unreachable(self, reason: str) -> None:
        """Say that the draft cannot be reached, with the likely cause: at once, then every
        UNREACHABLE_LOG_EVERY_S while it lasts (a newcomer's draft on loopback is never reached)."""
        if (failing := self._out_of_reach.seconds_to_log()) is not None:
            log.warning("cannot reach draft %s for %.0f s (%s): %s", self.address,
                        failing, reason, UNREACHABLE_HINT)


async def _send_all(call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[pb.TargetEvent]) -> None:
    while True:
        event = await outbox.get()
        try:
            await within(call.write(event), WRITE_STALL_S)
        except asyncio.TimeoutError:
            raise DraftStalled(f"it read none of the stream for {WRITE_STALL_S:g} s") from None


def _stalled(task: asyncio.Task) -> bool:
    return task.done() and not task.cancelled() and isinstance(task.exception(), DraftStalled)
