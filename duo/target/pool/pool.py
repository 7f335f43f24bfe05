"""Every draft of one target, and which one each session drafts on.

Drafts come and go: dialed ones (--peer, each a DraftLink that reconnects forever) and ones that dial in
(duo-draft --join: a JoinedDraft for as long as its call lasts). Each session is placed on the draft it adds
the most to (duo.target.pool.placement, from each draft's measured pace, acceptance and latency); it moves
when a faster draft joins or its draft falls behind, and at once when its draft is lost, turns incompatible
or refuses it. A move opens the session on the new draft with its committed tokens and closes it on the
old one; the session's chain starts afresh (its epochs are per draft), so no token of the old draft's is
ever verified for it after the move. Sessions wait unplaced (decoding alone) only while no draft is up
with room.

Each draft has its own switch (duo.target.switch): whether speculating with *that* draft beats decoding
alone is judged on its sessions' steps, against the target's one reference for decoding alone (shared:
it is the target's, at the target's load). A draft judged off adds nothing to placement's worth, so its
sessions move to a draft that pays, where there is one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from duo.net._proto import duo_pb2 as pb
from duo.costs import MovingAverage
from duo.target.policy import DraftTiming
from duo.target.pool.connection import DraftConnection, DraftObserver, LinkedSession
from duo.target.pool.placement import MOVE_COOLDOWN_S, DraftView, better_home, choose
from duo.target.switch import Switch

log = logging.getLogger("duo.pool")

REBALANCE_S = 0.5   # how often sessions are re-placed: stranded ones at once, one move per tick
ROOM_RETRY_S = 5.0  # a draft that refused a session for want of room is offered none for this long
# A draft judged off that has no session left gets no steps to judge it again: after this long it gets a fresh
# switch (an on trial), so that it is offered sessions again and judged on them.
RETRIAL_S = 30.0
# A draft that broke a bound (a chunk out of the vocabulary, the lead or its epochs; duo.net.wire) is offered no session
# for this long after its latest fault, and its sessions move to a draft that keeps them, where there is one.
FAULTY_FOR_S = 30.0
# A draft's pace is timed between two chunks with no commit between them (duo.target.generation): a draft slower
# than the target's steps is never timed so. One that served sessions this long untimed is taken to draft one token
# a session per target step, at best: so an untimed slow draft does not keep sessions a faster one would serve.
UNTIMED_GRACE_S = 3.0


class PooledSession(LinkedSession, Protocol):
    """A session as the pool moves it: it learns which draft's timing and switch now judge its steps."""

    def drafted_by(self, draft: str, timing: DraftTiming, switch: Switch) -> None: ...


class _PaceAverage(MovingAverage):
    """The draft's seconds per token as the session measures it, also kept by load for placement."""

    def __init__(self, view: DraftView) -> None:
        super().__init__(0.0)
        self.view = view

    def add(self, x: float) -> None:
        super().add(x)
        self.view.pace.observe(self.view.sessions, x)


@dataclass
class Member:
    """One draft of the pool: its connection, what placement knows of it, its switch and its timing."""

    connection: DraftConnection
    view: DraftView
    switch: Switch
    timing: DraftTiming
    dialing: asyncio.Task[None] | None = None  # a --peer's reconnect loop
    full_until: float = 0.0                    # refused a session for want of room until then
    idle_off_since: float | None = None        # judged off with no session since then
    untimed_since: float | None = None         # serving sessions with its pace untimed since then
    faults_seen: int = 0                       # the connection's fault count at the last look
    faulted_at: float | None = None            # when a new fault was seen last

    @property
    def name(self) -> str:
        return self.connection.address

    def describe(self) -> dict:
        """For /props, /health and metrics."""
        view, switch = self.view, self.switch
        seconds = view.pace.seconds_per_token(max(1, view.sessions))
        return {"address": self.name, "model": self.connection.draft_model, "state": self.connection.state,
                "sessions": len(self.connection.sessions), "error": self.connection.last_error,
                "tokens_per_second_per_session": 1.0 / seconds if seconds else None,
                "acceptance": view.acceptance.value if view.acceptance.weight > 0 else None,
                "latency_s": view.delay_s or None, "speculating": switch.speculating,
                "switch": switch.reason(), "connections": self.connection.connections}


@dataclass
class DraftPool:
    """The target's drafts. Target code registers sessions and sends their events here; the pool routes
    each event to the session's draft. `make_switch` builds a draft's switch (sharing the target's
    reference for decoding alone); `demand` says how many drafts a second one session can use now, `step_seconds`
    how long the target's steps take now (0: not known yet)."""

    make_switch: Callable[[], Switch]
    demand: Callable[[], float]
    step_seconds: Callable[[], float] = lambda: 0.0
    clock: Callable[[], float] = time.monotonic
    members: list[Member] = field(default_factory=list)
    sessions: dict[int, PooledSession] = field(default_factory=dict)
    home: dict[int, Member] = field(default_factory=dict)
    observers: list[DraftObserver] = field(default_factory=list)
    moves: int = 0
    _moved_at: dict[int, float] = field(default_factory=dict)
    _refused_by: dict[int, set[str]] = field(default_factory=dict)  # session -> drafts that refused it

    # What the target and the API read, as of one draft link before the pool.
    @property
    def connected(self) -> bool:
        return any(m.connection.connected for m in self.members)

    @property
    def state(self) -> str:
        """connected if any draft is, else incompatible if every draft is, else disconnected."""
        states = {m.connection.state for m in self.members}
        if "connected" in states:
            return "connected"
        return "incompatible" if states == {"incompatible"} else "disconnected"

    @property
    def address(self) -> str:
        return ", ".join(m.name for m in self.members)

    @property
    def last_error(self) -> str:
        """The drafts' latest errors, each after its address where there are several."""
        if len(self.members) == 1:
            return self.members[0].connection.last_error
        return "; ".join(f"{m.name}: {m.connection.last_error}" for m in self.members if m.connection.last_error)

    def describe(self) -> list[dict]:
        return [member.describe() for member in self.members]

    def serves(self, session_id: int) -> bool:
        """Whether the session is on a draft that is up (else it decodes alone, nothing is waited for)."""
        member = self.home.get(session_id)
        return member is not None and member.connection.connected

    # Drafts joining and leaving.
    def add(self, connection: DraftConnection, run: Callable[[], asyncio.Future] | None = None) -> Member:
        """A draft joins the pool; `run`: its connection loop, started here and stopped at remove()."""
        view = DraftView(connection.address)
        timing = DraftTiming(per_token=_PaceAverage(view))
        member = Member(connection, view, self.make_switch(), timing)
        connection.observers = self.observers
        connection.on_up = lambda _: self._rebalance_soon()
        connection.on_down = lambda _: self._evacuate(member)
        connection.on_session_refused = lambda _, session_id, why: self._refused(member, session_id, why)
        self.members.append(member)
        if run is not None:
            member.dialing = asyncio.ensure_future(run())
        log.info("draft %s joined the pool (%d draft(s))", member.name, len(self.members))
        self._rebalance_soon()
        return member

    async def remove(self, connection: DraftConnection) -> None:
        """A draft leaves: its sessions go elsewhere at once."""
        member = next((m for m in self.members if m.connection is connection), None)
        if member is None:
            return
        self.members.remove(member)
        if member.dialing is not None:
            member.dialing.cancel()
            await asyncio.gather(member.dialing, return_exceptions=True)
        self._evacuate(member)
        log.info("draft %s left the pool (%d draft(s))", member.name, len(self.members))

    # Sessions.
    def register(self, session: PooledSession) -> None:
        self.sessions[session.session_id] = session
        self._place(session)

    def unregister(self, session_id: int) -> None:
        self.sessions.pop(session_id, None)
        self._moved_at.pop(session_id, None)
        self._refused_by.pop(session_id, None)
        member = self.home.pop(session_id, None)
        if member is not None:
            member.connection.unregister(session_id)
            member.switch.request_done(session_id)
            member.view.sessions = len(member.connection.sessions)

    def send(self, event: pb.TargetEvent) -> None:
        """Route an event to its session's draft (dropped while it has none: its open will carry the state)."""
        kind = event.WhichOneof("event")
        member = self.home.get(getattr(event, kind).session_id) if kind else None
        if member is not None:
            member.connection.send(event)

    def observe_step(self, session_id: int, verified: int, accepted: int) -> None:
        """A step verified `verified` of the session's draft's tokens and accepted `accepted` of them."""
        member = self.home.get(session_id)
        if member is not None and verified:
            member.view.observe_acceptance(verified, accepted)

    def switches(self) -> list[Switch]:
        return [m.switch for m in self.members]

    async def run(self) -> None:
        """Re-place sessions every REBALANCE_S until cancelled (the dialed drafts run on tasks of their own)."""
        try:
            while True:
                await asyncio.sleep(REBALANCE_S)
                self.rebalance()
        finally:
            for member in list(self.members):
                await self.remove(member.connection)

    def rebalance(self) -> None:
        """Place every session that has no draft up; then move at most one session where it adds clearly more."""
        for session_id, session in list(self.sessions.items()):
            if not self.serves(session_id):
                self._place(session)
        self._move_one()

    def _rebalance_soon(self) -> None:
        try:
            asyncio.get_running_loop().call_soon(self.rebalance)
        except RuntimeError:  # no loop (tests building a pool by hand): the next tick does it
            pass

    def _views(self) -> list[DraftView]:
        """Placement's view of the drafts that are up, with what was measured since the last look."""
        now = self.clock()
        views = []
        for member in self.members:
            if not member.connection.connected:
                continue
            view = member.view
            view.sessions = len(member.connection.sessions)
            view.room = 0 if now < member.full_until else None
            view.delay_s = member.timing.latency.value if member.timing.latency.weight > 0 else 0.0
            view.judged_off = self._judged_off(member, now) or self._faulty(member, now)
            self._time_if_never_timed(member, now)
            views.append(view)
        return views

    def _time_if_never_timed(self, member: Member, now: float) -> None:
        """After UNTIMED_GRACE_S serving sessions untimed, the draft's pace is taken as one token per target step."""
        if member.view.pace.measured or not member.connection.sessions:
            member.untimed_since = None
        elif member.untimed_since is None:
            member.untimed_since = now
        elif now - member.untimed_since >= UNTIMED_GRACE_S and (step := self.step_seconds()) > 0:
            member.view.pace.observe(len(member.connection.sessions), step)

    @staticmethod
    def _faulty(member: Member, now: float) -> bool:
        """Whether the draft broke a bound within FAULTY_FOR_S (the bounds cut its chunks: it drafts for nothing)."""
        if member.connection.faults != member.faults_seen:
            member.faults_seen, member.faulted_at = member.connection.faults, now
        return member.faulted_at is not None and now - member.faulted_at < FAULTY_FOR_S

    def _judged_off(self, member: Member, now: float) -> bool:
        """Whether the member's switch found that it does not pay; a fresh trial after RETRIAL_S idle and off."""
        off = not member.switch.speculating and member.switch.gain is not None
        if not off or member.connection.sessions:
            member.idle_off_since = None
            return off
        if member.idle_off_since is None:
            member.idle_off_since = now
        elif now - member.idle_off_since >= RETRIAL_S:
            member.switch, member.idle_off_since = self.make_switch(), None
            return False
        return True

    def _member(self, view: DraftView) -> Member:
        return next(m for m in self.members if m.view is view)

    def _place(self, session: PooledSession, exclude: frozenset[str] = frozenset()) -> None:
        """Put the session on the draft it adds most to, among those up with room (else leave it where it is)."""
        refused = frozenset(self._refused_by.get(session.session_id, ()))
        view = choose(self._views(), self.demand(), exclude | refused)
        if view is not None:
            self._move(session, self._member(view))

    def _move(self, session: PooledSession, member: Member) -> None:
        old = self.home.get(session.session_id)
        if old is member:
            return
        if old is not None:
            old.connection.unregister(session.session_id)
            old.switch.request_done(session.session_id)
            old.view.sessions = len(old.connection.sessions)
            self.moves += 1
            log.info("session %d moved from draft %s to %s", session.session_id, old.name, member.name)
        self.home[session.session_id] = member
        self._moved_at[session.session_id] = self.clock()
        session.drafted_by(member.name, member.timing, member.switch)
        member.connection.register(session)
        member.view.sessions = len(member.connection.sessions)

    def _move_one(self) -> None:
        """Move the newest movable session of the first draft that has a clearly better home for one; every session
        of a draft judged off (or faulty) at once, as if it were lost, where a draft that is not has room."""
        views = self._views()
        now = self.clock()
        for view in views:
            target = better_home(view, views, self.demand())
            if target is None:
                continue
            member = self._member(view)
            if view.judged_off and not target.judged_off:
                self._evacuate(member)
                return
            movable = [sid for sid in member.connection.sessions
                       if now - self._moved_at.get(sid, 0.0) >= MOVE_COOLDOWN_S
                       and target.name not in self._refused_by.get(sid, ())]
            if movable:  # the newest: it has the fewest tokens for the new draft to read
                session_id = max(movable)
                self._move(self.sessions[session_id], self._member(target))
                return

    def _evacuate(self, member: Member) -> None:
        """The member's stream is down (or it left): its sessions go to drafts that are up."""
        for session_id in [sid for sid, home in self.home.items() if home is member]:
            session = self.sessions.get(session_id)
            if session is not None:
                self._place(session, exclude=frozenset({member.name}))

    def _refused(self, member: Member, session_id: int, why: str) -> None:
        """The draft ended a session (its capacity, or the session's own fault): try the others."""
        if "--max-sessions" in why:  # duo.draft.service.SessionLimits: full now, maybe not in a while
            member.full_until = self.clock() + ROOM_RETRY_S
        else:  # this session's own failure there (a bad grammar, a model error): not that draft again
            self._refused_by.setdefault(session_id, set()).add(member.name)
        session = self.sessions.get(session_id)
        if session is not None:
            self._place(session)
