"""One draft's stream as the target sees it, whoever dialed: sessions placed on it, their events out, the
draft's chunks in (checked first against each session's bounds), and what the draft did wrong, logged."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Protocol

from duo.net import wire
from duo.net._proto import duo_pb2 as pb
from duo.net.options import MAX_MESSAGE_BYTES
from duo.target.chain import DraftChain
from duo.llama.vocab import Vocab
from duo.net.wire import ChainChunk

log = logging.getLogger("duo.link")

# How far beyond the lead last told to the draft (max_ahead) a chain may reach: a Steer that
# shortened the lead crosses chunks drafted under the longer one (the adaptive policy's lead is at
# most 2 x 16 + 2), and anything further is a broken or hostile draft.
LEAD_MARGIN = 64
# Bounds an honest draft never breaks (duo.net.wire.REJECTION_REASONS): its epochs and positions may lag behind the
# target's commits in a race, but its tokens, distributions, lengths and lead are its own.
HOSTILE_REASONS = frozenset({"token", "distribution", "confidence", "length", "lead"})
# Longest text of the draft's own that is logged (its error messages are untrusted too).
MAX_LOGGED_CHARS = 200
# Longest model name a draft may give itself: it is kept for as long as the draft is in the pool, served on the
# public /health and /props and exported as a Prometheus label (a label per distinct value: a draft that renamed
# itself with megabytes, or at every join, would bloat every scrape). duo-draft sends its file's name and llama.cpp's
# description ("qwen2.5-coder-0.5b-instruct-q4_0.gguf (qwen2 0.5B Q4_0)"): even a long file name fits.
MAX_MODEL_NAME_CHARS = 128


class LinkedSession(Protocol):
    """What a draft connection needs from a target session."""

    session_id: int
    committed: list[int]
    chain: DraftChain
    max_ahead: int  # as last told to the draft

    def open_message(self) -> pb.OpenSession: ...
    def on_chunk(self, chunk: ChainChunk) -> None: ...
    def on_draft_lost(self) -> None: ...
    def on_draft_refused(self) -> None: ...


class DraftObserver(Protocol):
    """Something that watches what the target refuses from its drafts (metrics)."""

    def on_draft_rejected(self, reason: str, entries: int) -> None: ...


class DraftConnection:
    """A draft's side of the target: the sessions placed on it and the stream while it is up.

    Sessions registered here have their events sent on the stream while it is up and get the draft's
    chunks back, checked first: a chunk is cut at its first entry that breaks a bound. When the stream
    ends, its sessions are told (their chains reset) and `on_down` runs; while it is up again, every
    registered session is re-opened with its committed tokens so far. Nothing the draft does ends the
    target's work. Subclasses make the stream: DraftLink dials the draft, JoinedDraft is dialed.
    """

    def __init__(self, address: str, vocab: Vocab, *, max_lead: int) -> None:
        self.address = address
        self.vocab = vocab
        # The largest event an honest draft sends: a chunk of the longest lead the target allows, plus the margin.
        self.max_event_bytes = min(MAX_MESSAGE_BYTES, wire.max_chunk_bytes(max_lead + LEAD_MARGIN))
        self.sessions: dict[int, LinkedSession] = {}
        self.observers: list[DraftObserver] = []
        self.state = "disconnected"  # or "connected", "incompatible"
        self.last_error = ""
        self.connections = 0
        self.draft_model = ""  # as the draft named itself in the handshake (draft_model_name: clipped, printable)
        # The pool's hooks: the stream came up, went down, or the draft refused a session (SessionError).
        self.on_up: Callable[[DraftConnection], None] = lambda connection: None
        self.on_down: Callable[[DraftConnection], None] = lambda connection: None
        self.on_session_refused: Callable[[DraftConnection, int, str], None] = lambda connection, sid, why: None
        self._outbox: asyncio.Queue[pb.TargetEvent] | None = None
        self._faulted: set[int] = set()  # sessions whose draft faults were logged already
        self.faults = 0  # chunks cut for a bound no honest draft breaks (HOSTILE_REASONS): the pool judges it by them

    @property
    def connected(self) -> bool:
        return self.state == "connected"

    def register(self, session: LinkedSession) -> None:
        self.sessions[session.session_id] = session
        self.send(pb.TargetEvent(open=session.open_message()))

    def unregister(self, session_id: int) -> None:
        self._faulted.discard(session_id)
        if self.sessions.pop(session_id, None) is not None:
            self.send(pb.TargetEvent(close=pb.CloseSession(session_id=session_id)))

    def send(self, event: pb.TargetEvent) -> None:
        """Queue an event for the draft; dropped while the stream is down (sessions re-open when it is up)."""
        if self._outbox is not None:
            self._outbox.put_nowait(event)

    def _stream_up(self) -> asyncio.Queue[pb.TargetEvent]:
        """A new stream: every registered session opens on it; returns the outbox it writes."""
        outbox: asyncio.Queue[pb.TargetEvent] = asyncio.Queue()
        for session in self.sessions.values():
            outbox.put_nowait(pb.TargetEvent(open=session.open_message()))
        self._outbox = outbox
        self.state, self.last_error = "connected", ""
        self.connections += 1
        log.info("draft %s connected (model %s, protocol %s); speculating for %d running session(s)", self.address,
                 clip(self.draft_model), wire.PROTOCOL, len(self.sessions))
        self.on_up(self)
        return outbox

    def _stream_down(self) -> None:
        """The stream ended: nothing more is sent, and the sessions' chains from it are void."""
        self._outbox = None
        for session in self.sessions.values():
            session.on_draft_lost()

    def _went_down(self, state: str, reason: str) -> None:
        """Record the state after the stream ended or was refused, and tell the pool."""
        self.state, self.last_error = state, clip(reason)
        self.on_down(self)

    def on_event(self, event: pb.DraftEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "chunk":
            session = self.sessions.get(event.chunk.session_id)
            if session is not None:  # else a session that ended (or moved) meanwhile
                self._on_chunk(session, event.chunk)
        elif kind == "error" and event.error.session_id in self.sessions:
            message = clip(event.error.message)
            self.sessions[event.error.session_id].on_draft_refused()
            self._fault(event.error.session_id, f"refused it: {message}")
            self.on_session_refused(self, event.error.session_id, message)

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
            self.faults += rejection.reason in HOSTILE_REASONS
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


def clip(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """A peer's text fit for a log line or a JSON field: at most `limit` characters (and "..."), and control
    characters as "?" (a newline in it would forge a log line of its own)."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return text if text.isprintable() else "".join(char if char.isprintable() else "?" for char in text)


def draft_model_name(text: str) -> str:
    """The model name a draft gave in its Hello, as the target keeps, logs and serves it."""
    return clip(text, MAX_MODEL_NAME_CHARS) or "unnamed"
