"""duo-draft's gRPC service (proto/duo.proto): a stream per target, its sessions opened, fed and refused."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterable, AsyncIterator, Callable

import grpc

from duo.net import wire
from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.draft.drafter import Drafted, Drafter, InvalidEvent
from duo.draft.metrics import DraftMetrics
from duo.draft.session import DraftSession
from duo.llama.model import Model, ModelError
from duo.llama.vocab import IncompatibleVocab, check_compatible

log = logging.getLogger("duo.draft")


@dataclass(frozen=True)
class SessionLimits:
    """How many sessions the draft drafts for (each a slot of sequences in its one KV cache): in all, and per target."""

    total: int = 64
    per_target: int = 16

    def refusal(self, target_sessions: int, all_sessions: int) -> tuple[str, str] | None:
        """(reason, message) when one more session would exceed a limit, else None."""
        if target_sessions >= self.per_target:
            return "max_sessions_per_target", (f"this target has {target_sessions} draft sessions already "
                                               f"(duo-draft --max-sessions-per-target {self.per_target})")
        if all_sessions >= self.total:
            return "max_sessions", f"the draft holds {all_sessions} sessions already (duo-draft --max-sessions {self.total})"
        return None


def refusal_reason(error: Exception) -> str:
    """The duo_draft:sessions_refused_total label of a session's failure."""
    if isinstance(error, InvalidEvent):
        return "invalid_event"
    return "model_error" if isinstance(error, ModelError) else "internal"


DRAIN_S = 5.0  # how long duo-draft's stop waits for its streams to close and free their sessions

class DraftServicer(pb_grpc.DraftServicer):
    """The draft side of proto/duo.proto."""

    def __init__(self, drafter: Drafter, limits: SessionLimits, metrics: DraftMetrics) -> None:
        self.drafter = drafter
        self.limits = limits
        self.metrics = metrics
        self.vocab = drafter.model.vocab()
        self.connections: set[Connection] = set()
        self._no_connections = asyncio.Event()  # set while none is open: what drain waits for
        self._no_connections.set()
        self.wake = asyncio.Event()  # a target sent something: a session may have work
        self.rounds: asyncio.Task[None] | None = None  # while targets are connected
        self.stopping = False  # set by the process's stop (SIGTERM): streams it cuts are no faults
        self.drafted = 0  # tokens drafted since the last activity line
        self.logged_at = time.monotonic()
        metrics.watch(sessions_open=self.sessions_open, connections=lambda: len(self.connections),
                      kv_cells_used=lambda: drafter.cells_used)

    def stop(self) -> None:
        self.stopping = True

    async def drain(self, within_s: float = DRAIN_S) -> None:
        """End every target's stream from this side and free its sessions, so that duo-draft stops with each
        stream closed and said so, not cut when grpc's grace runs out (the loop may end before a cut stream's
        release is done)."""
        for connection in self.connections:
            connection.end()
        try:
            await asyncio.wait_for(self._no_connections.wait(), within_s)
        except TimeoutError:
            log.warning("%d target stream(s) still open %.0f s after duo-draft began to stop", len(self.connections),
                        within_s)

    def sessions_open(self) -> int:
        """Sessions holding (or getting) a slot, over all connections."""
        return sum(connection.holding for connection in self.connections)

    def hello(self) -> pb.Hello:
        """What this draft tells a target about itself: the protocol, its model, its vocabulary."""
        return pb.Hello(protocol=wire.PROTOCOL, model=describe(self.drafter.model), vocab=wire.vocab_to_pb(self.vocab))

    def refusal(self, target: pb.Hello) -> str | None:
        """Why this draft cannot draft for the target that sent `target` (None: it can)."""
        if target.protocol != wire.PROTOCOL:
            return f"protocol {target.protocol!r} is not {wire.PROTOCOL!r}: run the same duo version on both sides"
        try:
            check_compatible(wire.vocab_from_pb(target.vocab), self.vocab)
        except IncompatibleVocab as error:
            model = target.model[:200]  # the target's own text, into the log
            return f"draft {self.drafter.model.path.name} cannot draft for target {model}: {error}"
        return None

    async def Handshake(self, request: pb.Hello, context: grpc.aio.ServicerContext) -> pb.Hello:
        peer = context.peer()
        if (refusal := self.refusal(request)) is not None:
            log.error("refused target %s: %s", peer, refusal)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        log.info("target %s connected (%s)", peer, request.model)
        return self.hello()

    async def Speculate(self, request_iterator: AsyncIterable[pb.TargetEvent],
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DraftEvent]:
        # Closed here, not left to the garbage collector: its end frees the target's sessions.
        async with aclosing(self.serve(request_iterator, context.peer())) as events:
            async for event in events:
                yield event

    async def serve(self, target_events: AsyncIterable[pb.TargetEvent], peer: str) -> AsyncIterator[pb.DraftEvent]:
        """Draft for one target: its events in, the draft's out, until it ends its events or the stream breaks.
        A target that dialed the draft (Speculate) and one the draft joined (duo.draft.joining) are served alike."""
        connection = Connection(self.drafter, self.limits, self.metrics, self.sessions_open, self.wake.set,
                                peer, lambda: self.stopping)
        self.connections.add(connection)
        self._no_connections.clear()
        if self.rounds is None or self.rounds.done():  # done: it failed, and said why in the log
            self.rounds = asyncio.create_task(self._draft_rounds())
            self.rounds.add_done_callback(_rounds_ended)
        connection.start(target_events)
        try:
            while (event := await connection.next_event()) is not None:
                yield event
        finally:
            try:
                await connection.stop()
            finally:
                self.connections.discard(connection)
                if not self.connections:
                    self._no_connections.set()
                    if self.rounds is not None:
                        self.rounds.cancel()
                        self.rounds = None

    async def _draft_rounds(self) -> None:
        """Round after round, one batched model call drafts for every session of every target that has
        work (Drafter.draft_round); when none has, sleep until a target sends something. A commit that
        arrives during a round waits at most that round for its chain."""
        while True:
            self.wake.clear()
            owners = {session: connection for connection in self.connections
                      for session in connection.sessions.values()}
            drafted = await self.drafter.draft_round(owners)
            if not drafted:
                await self.wake.wait()
                continue
            # Chunks first: ending a failed session waits for its release on the model thread.
            for result in sorted(drafted, key=lambda result: result.error is not None):
                await owners[result.session].deliver(result)
            self._log_activity(sum(len(result.chunk.tokens) for result in drafted if result.chunk is not None))

    def _log_activity(self, tokens: int) -> None:
        """Every ACTIVITY_LOG_S while drafting: sessions, targets and tokens drafted (silent when idle)."""
        self.drafted += tokens
        now = time.monotonic()
        if now - self.logged_at >= ACTIVITY_LOG_S:
            log.info("drafting: %d session(s) for %d target(s); %d tokens drafted in the last %.0f s",
                     self.sessions_open(), len(self.connections), self.drafted, now - self.logged_at)
            self.drafted, self.logged_at = 0, now


def _rounds_ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("drafting stopped on an error", exc_info=task.exception())


# While drafting, duo-draft logs what it does this often.
ACTIVITY_LOG_S = 60.0
# Events one target's stream may hold unsent. An honest target reads them within a round or two (a
# few per session); one that sends commits but never reads would grow the draft's memory without end:
# past this many, its sessions end and its stream with them.
MAX_OUTBOX = 4096
# ... or that has left an event waiting this long (the target's own link gives up on a draft that
# sends nothing for as long). Timed from the oldest waiting event, not from the last event taken: a
# link idle for minutes (no requests, or a resting draft) has nothing waiting, and no stalled reader.
OUTBOX_STALL_S = 30.0


class Connection:
    """One target's stream (Speculate, or a joined target's Join): its sessions, and the events going back to it.

    A session that cannot be opened, or fails while drafting or following the target's events, gets
    a SessionError and loses its slot; the stream and the other sessions go on.
    """

    def __init__(self, drafter: Drafter, limits: SessionLimits, metrics: DraftMetrics,
                 all_sessions: Callable[[], int], wake: Callable[[], None], peer: str,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.drafter = drafter
        self.limits = limits
        self.metrics = metrics
        self.all_sessions = all_sessions
        self.peer = peer
        self.stopping = stopping  # duo-draft is shutting down: streams end on grpc's stop, not on a fault
        self.sessions: dict[int, DraftSession] = {}
        self.opening = 0  # sessions being opened
        self.outbox: asyncio.Queue[pb.DraftEvent | None] = asyncio.Queue()  # None ends the stream
        self._ready: collections.deque[pb.DraftEvent | None] = collections.deque()  # taken, coalesced
        self.wake = wake
        self.reader: asyncio.Task[None] | None = None
        self.overflowed = False  # the target stopped reading (MAX_OUTBOX, OUTBOX_STALL_S): the stream ends
        self.waiting_since = 0.0  # when the oldest event in the outbox was queued (meaningless while it is empty)
        self._closing: asyncio.Future[None] | None = None  # its sessions' release, once it overflowed
        # Sessions being opened (on tasks of their own), each with the events that came for it meanwhile.
        self._opening: dict[int, collections.deque[tuple[str, Any]]] = {}
        self._openings: set[asyncio.Task[None]] = set()

    @property
    def holding(self) -> int:
        return len(self.sessions) + self.opening

    def start(self, request_iterator: AsyncIterable[pb.TargetEvent]) -> None:
        self.reader = asyncio.create_task(self._read(request_iterator))
        self.reader.add_done_callback(self._ended)

    def end(self) -> None:
        """End the stream from the draft's side (duo-draft stops): what is queued goes out first."""
        self.outbox.put_nowait(None)

    async def next_event(self) -> pb.DraftEvent | None:
        """The next event to write: what queued up while the stream wrote the last one goes out with the
        chunks of each line merged (wire.coalesce), so a stream that falls behind catches up."""
        if self.overflowed:
            return None
        if not self._ready:
            events = [await self.outbox.get()]
            while not self.outbox.empty():
                events.append(self.outbox.get_nowait())
            self._ready.extend(wire.coalesce(events))
        return self._ready.popleft()

    async def stop(self) -> None:
        """End the stream's work and free every slot it holds, whatever was under way."""
        self.reader.cancel()
        for opening in self._openings:
            opening.cancel()  # before the sessions are gathered: none is added after
        await asyncio.gather(*self._openings, return_exceptions=True)
        sessions = list(self.sessions.values())
        self.sessions.clear()
        await self.drafter.close(*sessions)
        if self._closing is not None:
            await self._closing  # the sessions it lost when it stopped reading: freed before the stream is gone
        await asyncio.wait([self.reader])
        if self.stopping():
            log.info("target %s: stream closed as duo-draft stops; closed %d session(s)", self.peer, len(sessions))
        else:
            log.info("target %s left; closed %d session(s)", self.peer, len(sessions))

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The target closed its side, or the stream broke: end the stream."""
        error = None if task.cancelled() else task.exception()
        if error is not None and self.stopping():
            log.info("target %s: stream closed as duo-draft stops", self.peer)
        elif error is not None:
            log.error("target %s: the stream ended on an error", self.peer, exc_info=error)
        self.outbox.put_nowait(None)

    async def _read(self, request_iterator: AsyncIterable[pb.TargetEvent]) -> None:
        async for event in request_iterator:
            kind = event.WhichOneof("event")
            if kind is not None:
                await self._dispatch(kind, getattr(event, kind))
            self.wake()

    async def _dispatch(self, kind: str, message: pb.OpenSession | pb.Commit | pb.Steer | pb.CloseSession) -> None:
        """Open a session on a task of its own (compiling its grammar takes up to duo.constraint.COMPILE_BUDGET_S,
        which the other sessions' commits, steers and opens must not wait for); an event for a session being
        opened waits for its open, in the order it came."""
        queued = self._opening.get(message.session_id)
        if queued is not None:
            queued.append((kind, message))
        elif kind == "open":
            self._opening[message.session_id] = collections.deque()
            task = asyncio.create_task(self._open_then_follow(message))
            self._openings.add(task)
            task.add_done_callback(self._openings.discard)
        else:
            await self._follow(kind, message)

    async def _open_then_follow(self, message: pb.OpenSession) -> None:
        """Open the session, then apply what came for it meanwhile; from then on its events go straight through."""
        queued = self._opening[message.session_id]
        try:
            await self._open(message)
            while queued:
                kind, event = queued.popleft()
                await (self._open(event) if kind == "open" else self._follow(kind, event))
        finally:
            del self._opening[message.session_id]
        self.wake()

    async def _open(self, message: pb.OpenSession) -> None:
        if (old := self.sessions.pop(message.session_id, None)) is not None:
            await self.drafter.close(old)  # the target re-opens a session after a reconnect of its own
        refusal = self.limits.refusal(len(self.sessions) + self.opening, self.all_sessions())
        if refusal is not None:
            self._refuse(message.session_id, *refusal)
            return
        self.opening += 1
        try:
            self.sessions[message.session_id] = await self.drafter.open(message)
        except Exception as error:  # whatever it is, it concerns this session alone
            self._refuse(message.session_id, refusal_reason(error), str(error), error)
        finally:
            self.opening -= 1

    async def _follow(self, kind: str, message: pb.Commit | pb.Steer | pb.CloseSession) -> None:
        """Apply a commit, steer or close; events for a session the draft refused are ignored."""
        session = self.sessions.get(message.session_id)
        if session is None:
            return
        try:
            if kind == "commit":
                self.drafter.commit(session, message.start, message.tokens, wire.mu_from_pb(message))
            elif kind == "steer":
                self.drafter.steer(session, message.max_ahead)
            else:
                del self.sessions[session.session_id]
                await self.drafter.close(session)
        except Exception as error:  # whatever it is, it concerns this session alone
            await self._fail(session, error)

    async def deliver(self, drafted: Drafted) -> None:
        """Send what a round drafted for one of this stream's sessions, or end that session on its error."""
        if drafted.error is not None:
            await self._fail(drafted.session, drafted.error)
        elif drafted.chunk is not None:
            self._put(pb.DraftEvent(chunk=drafted.chunk))
            self.metrics.chunks_sent.inc()

    def _put(self, event: pb.DraftEvent) -> None:
        """Queue an event for the target, unless it has stopped reading (MAX_OUTBOX events waiting, or one
        waiting for OUTBOX_STALL_S): then its sessions end, nothing more is queued, and the stream ends
        when grpc next asks for an event."""
        if self.overflowed:
            return
        now, waiting = time.monotonic(), self.outbox.qsize()
        if not waiting:
            self.waiting_since = now  # next_event takes the whole outbox at once: this event is its oldest
        stalled = waiting and now - self.waiting_since > OUTBOX_STALL_S
        if waiting < MAX_OUTBOX and not stalled:
            self.outbox.put_nowait(event)
            return
        self.overflowed = True
        log.warning("target %s stopped reading (%d events waiting, the oldest for %.0f s); ending its stream and "
                    "its %d session(s)", self.peer, waiting, now - self.waiting_since, len(self.sessions))
        while not self.outbox.empty():
            self.outbox.get_nowait()
        self.outbox.put_nowait(None)
        self.reader.cancel()  # no more events from it
        sessions = list(self.sessions.values())
        self.sessions.clear()  # no more drafting for it
        self._closing = asyncio.ensure_future(self.drafter.close(*sessions))

    async def _fail(self, session: DraftSession, error: Exception) -> None:
        """End an open session with a SessionError and free its slot."""
        if session.closed:
            return  # the target closed it meanwhile: nobody waits for an error
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
        self._refuse(session.session_id, refusal_reason(error), str(error), error)
        await self.drafter.close(session)

    def _refuse(self, session_id: int, reason: str, message: str, error: Exception | None = None) -> None:
        """Tell the target that `session_id` goes on without the draft, and log why (once)."""
        # An error nobody foresaw is a bug: its traceback is what will fix it.
        trace = error if reason == "internal" else None
        log.warning("target %s: session %d goes on without the draft (%s): %s", self.peer, session_id, reason,
                    message, exc_info=trace)
        self.metrics.refused(reason)
        self._put(pb.DraftEvent(error=pb.SessionError(session_id=session_id, message=message)))


def describe(model: Model) -> str:
    return f"{model.path.name} ({model.description})"
