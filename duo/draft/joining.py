"""duo-draft --join: keep the draft joined to one duo-target (its Pool service), whatever the target does."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import AsyncIterator

import grpc

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.draft.service import DraftServicer
from duo.net.options import grpc_channel_options
from duo.net.reconnect import Unreachable, keep_reconnecting
from duo.net.timeouts import within

log = logging.getLogger("duo.draft")

# A target that accepts the call but never answers (stopped, overloaded) is given up after this long: its
# Hello carries a vocabulary of a few MB.
HELLO_TIMEOUT_S = 30.0
# A target that refused this draft (another model, an address it does not allow) is asked again this often,
# since it may be restarted with another model or list.
REFUSED_RETRY_S = 30.0
# A target that answers pings but reads none of the stream fills the HTTP/2 window, and a write would wait
# forever: one blocked this long drops the stream, and the draft joins again.
WRITE_STALL_S = 30.0
UNREACHABLE_HINT = ("is duo-target running there with --draft-listen on that port, reachable from this machine "
                    "(the port open in the firewall)?")
# Longest text of the target's own that is logged (a hostile target may send megabytes).
MAX_LOGGED_CHARS = 200


class Joiner:
    """Keeps duo-draft joined to the target at `address`: dial, exchange Hellos, then draft for it exactly as
    for a target that dialed in (DraftServicer.serve), and join again when the stream ends. A refusal, a
    broken stream or a bug here costs this target's sessions, never the draft process."""

    def __init__(self, servicer: DraftServicer, address: str,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.servicer = servicer
        self.address = address
        self.credentials = credentials
        self.state = "disconnected"  # or "joined", "refused"
        self.last_error = ""
        self._hello = pb.JoinUp(hello=servicer.hello())  # built once: it carries the whole vocabulary
        self._out_of_reach = Unreachable()
        self._ended_why = ""  # why the target's events ended (set while reading them)

    async def run(self) -> None:
        """Join, serve, and join again until duo-draft stops (or this is cancelled); never raises otherwise."""
        def bug(error: Exception) -> None:  # a bug here must cost this target's sessions, not the draft process
            log.error("joining target %s failed; joining again", self.address, exc_info=error)
            self._lost(f"internal error: {error!r}")

        await keep_reconnecting(self._join_once, bug, lambda: self.state == "refused", REFUSED_RETRY_S,
                                lambda: not self.servicer.stopping)

    async def _join_once(self) -> None:
        options = grpc_channel_options()  # the target's Hello carries its vocabulary: the full message limit
        channel = (grpc.aio.secure_channel(self.address, self.credentials, options=options) if self.credentials
                   else grpc.aio.insecure_channel(self.address, options=options))
        async with channel:
            call = pb_grpc.PoolStub(channel).Join()
            try:
                if await self._exchange_hellos(call):
                    self._lost(await self._serve(call))
            except grpc.aio.AioRpcError as error:
                self._failed(error)
            finally:
                call.cancel()

    async def _exchange_hellos(self, call: grpc.aio.StreamStreamCall) -> bool:
        """Send this draft's Hello, check the target's; False when either side refuses, or the target sends none."""
        try:
            await within(call.write(self._hello), HELLO_TIMEOUT_S)
            reply = await within(call.read(), HELLO_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._lost(f"it sent no Hello within {HELLO_TIMEOUT_S:g} s")
            return False
        except asyncio.InvalidStateError:  # the call ended while the Hello was written: read says how
            reply = await call.read()
        if reply is grpc.aio.EOF or reply.WhichOneof("message") != "hello":
            self._lost("it sent no Hello first")
            return False
        if (refusal := self.servicer.refusal(reply.hello)) is not None:
            self._refused(f"this draft refused it: {refusal}")
            return False
        self._joined(reply.hello)
        return True

    async def _serve(self, call: grpc.aio.StreamStreamCall) -> str:
        """Draft for the target until its stream ends; why it ended."""
        self._ended_why = "the stream ended"  # the draft's side ended it (duo.draft.service says why)
        try:
            # Closed however the stream ends (even by a cancellation at a write): its end frees the target's sessions.
            async with aclosing(self.servicer.serve(self._target_events(call), self.address)) as events:
                async for event in events:
                    await within(call.write(pb.JoinUp(event=event)), WRITE_STALL_S)
        except asyncio.TimeoutError:
            return f"it read none of the stream for {WRITE_STALL_S:g} s"
        except asyncio.InvalidStateError:  # the call ended while an event was written
            return await _status(call)
        return self._ended_why

    async def _target_events(self, call: grpc.aio.StreamStreamCall) -> AsyncIterator[pb.TargetEvent]:
        """The TargetEvents of the target's JoinDown messages, until the call ends (its status kept as the
        reason, so that a target going away ends the stream as calmly as a target closing it)."""
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                if message.WhichOneof("message") == "event":
                    yield message.event  # another Hello, or a message of a later protocol: nothing to act on
            self._ended_why = "the target ended the stream"
        except grpc.aio.AioRpcError as error:
            self._ended_why = _describe(error)

    def _joined(self, target: pb.Hello) -> None:
        self.state, self.last_error = "joined", ""
        self._out_of_reach.reached()
        log.info("joined target %s (model %s)", self.address, _clip(target.model or "unnamed"))

    def _failed(self, error: grpc.aio.AioRpcError) -> None:
        """The call failed: the target refused this draft (FAILED_PRECONDITION, PERMISSION_DENIED), is full
        (RESOURCE_EXHAUSTED: as many drafts as its port takes, or a Hello beyond its bound), or is gone."""
        if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
            self._refused(f"it refused this draft: {_clip(error.details() or 'no reason given')}")
        elif error.code() == grpc.StatusCode.PERMISSION_DENIED:
            self._refused(f"it does not allow this draft's address (duo-target --draft-allow): "
                          f"{_clip(error.details() or 'no reason given')}")
        elif error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._refused(f"it takes no more drafts now: {_clip(error.details() or 'no reason given')}")
        else:
            self._lost(_describe(error))

    def _refused(self, reason: str) -> None:
        if self.state != "refused" or reason != self.last_error:
            log.error("cannot draft for target %s (asking again every %.0f s): %s", self.address, REFUSED_RETRY_S,
                      reason)
        self.state, self.last_error = "refused", reason

    def _lost(self, reason: str) -> None:
        reason = _clip(reason)
        if self.state == "joined":
            log.warning("lost target %s (%s); joining again", self.address, reason)
        else:
            self._unreachable(reason)
        self.state, self.last_error = "disconnected", reason

    def _unreachable(self, reason: str) -> None:
        """Say that the target cannot be reached, with the likely cause: at once, then every
        UNREACHABLE_LOG_EVERY_S while it lasts."""
        if (failing := self._out_of_reach.seconds_to_log()) is not None:
            log.warning("cannot join target %s for %.0f s (%s): %s", self.address, failing, reason,
                        UNREACHABLE_HINT)


async def join_all(joiners: list[Joiner]) -> None:
    """Keep every joiner joined, until cancelled (duo-draft's stop)."""
    await asyncio.gather(*(joiner.run() for joiner in joiners))


async def _status(call: grpc.aio.StreamStreamCall) -> str:
    """How a call that has ended ended, for the log."""
    code = await call.code()
    if code == grpc.StatusCode.OK:
        return "the target ended the stream"
    return f"{code.name}: {_clip(await call.details() or '')}"


def _describe(error: grpc.aio.AioRpcError) -> str:
    return f"{error.code().name}: {_clip(error.details() or '')}"


def _clip(text: str) -> str:
    return text if len(text) <= MAX_LOGGED_CHARS else text[:MAX_LOGGED_CHARS] + "..."
