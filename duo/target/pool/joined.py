"""Drafts that dial in (duo-draft --join): duo-target --draft-listen serves proto's Pool.Join, checks the draft's
address and Hello, and keeps it in the pool for as long as its call lasts."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import AsyncIterator
from urllib.parse import unquote

import grpc

from duo.net import wire
from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.net.options import grpc_server_options
from duo.net.timeouts import within
from duo.target.pool.link import WRITE_STALL_S  # a draft that reads none of the stream this long is dropped
from duo.target.pool.connection import DraftConnection, clip, draft_model_name
from duo.target.pool.pool import DraftPool
from duo.llama.vocab import IncompatibleVocab, Vocab, check_compatible

log = logging.getLogger("duo.pool")

HELLO_TIMEOUT_S = 30.0  # a caller that sends no Hello within this is dropped
# The largest message the pool's port reads: a draft's Hello, which carries its whole vocabulary (each token's text
# and two or three bytes of framing). Measured: Qwen2.5's 151,936 tokens make a Hello of 1.7 MB, Llama 3's 128,256
# one of 1.3 MB, Gemma's 262,144 one of 2.8 MB; 16 MiB leaves Gemma five times its room, and no caller can make the
# target parse 64 MiB (duo.net.options.MAX_MESSAGE_BYTES, the other ports' limit) before any check.
MAX_JOIN_MESSAGE_BYTES = 16 * 1024 * 1024
# Join calls at once (beyond: RESOURCE_EXHAUSTED): a joined draft holds one for as long as it stays, a caller that
# sends no Hello one for HELLO_TIMEOUT_S. Far more drafts than one target's sessions can use.
MAX_JOIN_CALLS = 64

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_allow(values: list[str]) -> list[Network]:
    """--draft-allow's networks ("10.0.0.0/8", "192.168.1.7", "::1"); ValueError naming a bad one."""
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError:
            raise ValueError(f"--draft-allow {value!r} is no address or network (e.g. 10.0.0.0/8, 192.168.1.7)") from None
    return networks


def pool_server() -> grpc.aio.Server:
    """The gRPC server of --draft-listen: duo's server options, with its messages and calls bounded."""
    options = [(name, MAX_JOIN_MESSAGE_BYTES if name == "grpc.max_receive_message_length" else value)
               for name, value in grpc_server_options()]
    return grpc.aio.server(options=options, maximum_concurrent_rpcs=MAX_JOIN_CALLS)


def peer_host(peer: str) -> str:
    """The address in grpc's peer string: "ipv4:10.0.0.2:5000" -> 10.0.0.2, "ipv6:[::1]:5000" -> ::1 (grpc writes
    the brackets as %5B and %5D)."""
    kind, _, rest = unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    host = rest.rpartition(":")[0]
    return host.strip("[]")


def allowed(peer: str, networks: list[Network]) -> bool:
    """No list allows everyone (mutual TLS may still stand guard); else the peer's address must be in one (grpc
    names an IPv4 draft reaching a port on [::] by its IPv4 address)."""
    if not networks:
        return True
    try:
        address = ipaddress.ip_address(peer_host(peer))
    except ValueError:
        return False
    return any(address in network for network in networks)


class JoinedDraft(DraftConnection):
    """A draft that dialed in: its stream is its Join call; when the call ends, the draft leaves the pool."""

    async def serve(self, incoming: AsyncIterator[pb.JoinUp], context: grpc.aio.ServicerContext) -> str:
        """Write the target's events and read the draft's until either side ends; the reason it ended."""
        outbox = self._stream_up()
        reading = asyncio.create_task(self._read_all(incoming))
        reason = "the call was cancelled"
        try:
            reason = await self._write_all(outbox, reading, context)
            return reason
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            self._stream_down()
            self._went_down("disconnected", reason)

    @staticmethod
    async def _write_all(outbox: asyncio.Queue[pb.TargetEvent], reading: asyncio.Task[None],
                         context: grpc.aio.ServicerContext) -> str:
        while True:
            getting = asyncio.ensure_future(outbox.get())
            try:
                await asyncio.wait({getting, reading}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not getting.done():  # the draft's side ended, or the call was cancelled: stop waiting too
                    getting.cancel()
            if not getting.done():
                error = None if reading.cancelled() else reading.exception()
                return clip(str(error)) if error is not None else "the draft ended its call"
            try:
                await within(context.write(pb.JoinDown(event=getting.result())), WRITE_STALL_S)
            except asyncio.TimeoutError:
                return f"it read none of the stream for {WRITE_STALL_S:g} s"

    async def _read_all(self, incoming: AsyncIterator[pb.JoinUp]) -> None:
        async for message in incoming:
            if message.WhichOneof("message") != "event":
                raise ValueError("the draft sent a second Hello")
            if message.ByteSize() > self.max_event_bytes:
                raise ValueError(f"the draft sent an event of {message.ByteSize()} bytes, beyond any honest chunk")
            self.on_event(message.event)


class PoolService(pb_grpc.PoolServicer):
    """proto's Pool: a draft dials in, the target checks it and adds it to the pool for the call's life."""

    def __init__(self, pool: DraftPool, model_name: str, vocab: Vocab, *, max_lead: int,
                 allow: list[Network] | None = None) -> None:
        self.pool = pool
        self.vocab = vocab
        self.max_lead = max_lead
        self.allow = allow or []
        self._hello = pb.Hello(protocol=wire.PROTOCOL, model=model_name, vocab=wire.vocab_to_pb(vocab))

    async def Join(self, request_iterator: AsyncIterator[pb.JoinUp], context: grpc.aio.ServicerContext) -> None:
        peer = context.peer()
        if not allowed(peer, self.allow):
            log.warning("refused draft %s: its address is off --draft-allow", peer)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{peer_host(peer) or peer} is not on this target's --draft-allow list")
        hello = await self._hello_of(request_iterator, context)
        await context.write(pb.JoinDown(hello=self._hello))
        # Named by its address and port as the target sees them: two drafts joining from one machine stay apart.
        name = f"{unquote(peer).partition(':')[2] or peer} (joined)"
        draft = JoinedDraft(name, self.vocab, max_lead=self.max_lead)
        draft.draft_model = draft_model_name(hello.model)
        self.pool.add(draft)
        try:
            reason = await draft.serve(request_iterator, context)
            log.warning("joined draft %s left (%s)", peer, reason)
        finally:
            await self.pool.remove(draft)

    async def _hello_of(self, request_iterator: AsyncIterator[pb.JoinUp],
                        context: grpc.aio.ServicerContext) -> pb.Hello:
        """The draft's Hello, checked as duo-draft checks a target's; the call fails where the pair cannot work."""
        try:
            first = await within(anext(aiter(request_iterator)), HELLO_TIMEOUT_S)
        except (asyncio.TimeoutError, StopAsyncIteration):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "send a Hello first (duo-draft --join does)")
        if first.WhichOneof("message") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be the draft's Hello")
        hello = first.hello
        try:
            if hello.protocol != wire.PROTOCOL:
                raise IncompatibleVocab(f"the draft speaks protocol {clip(hello.protocol)!r}, not {wire.PROTOCOL!r}: "
                                        "run the same duo version on both sides")
            # Off the event loop: reading and comparing a vocabulary of 150k texts takes tens of milliseconds, and
            # anyone the port lets in may join again and again.
            await asyncio.to_thread(lambda: check_compatible(self.vocab, wire.vocab_from_pb(hello.vocab)))
        except IncompatibleVocab as error:
            message = f"draft {clip(hello.model)} cannot draft for this target: {error}"
            log.error("refused draft %s: %s", context.peer(), message)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
        return hello
