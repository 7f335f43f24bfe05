"""The draft's batched step: one llama context holds every session's sequences, and one decode per round
drafts the next token of each work: a session's chain, its branch, or both."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from duo.constraint import GrammarError
from duo.draft.branches import Branch, Doubt
from duo.draft.session import DraftSession, Drawn, Slot, draw, proposes
from duo.draft.value import Round
from duo.model import Context, ModelError, Part, common_prefix_length


@dataclass(frozen=True)
class Work:
    """One session's share of a round, planned on the event loop from a snapshot of the session: draw
    the token after `tokens`, on the chain's sequence, or on the branch sequence when `fork` is set
    (tokens = the chain up to the fork, then the branch's tokens so far)."""

    session: DraftSession
    tokens: list[int]
    epoch: int       # the session's epoch, commits and chain length when planned: a result drafted
    commits: int     # before a later commit is stale
    chain_len: int
    fork: int | None = None
    growing: Branch | None = None  # branch work: the branch it grows (None: it starts one at `fork`)
    doubt: Doubt | None = None     # a new branch: the Doubt of its fork, whose alternative it assumes

    @property
    def seq(self) -> int:
        return self.session.slot.chain if self.fork is None else self.session.slot.branch


@dataclass(frozen=True)
class Step:
    """What a round made of one Work: a token drawn, a pause (the draft is too unsure: p_min), an error
    for its session alone, or none of these: its catch-up goes on next round (it did not fit the batch)."""

    drawn: Drawn | None = None
    paused: bool = False
    error: Exception | None = None


@dataclass(frozen=True)
class RoundReport:
    """One round's model call, for the metrics."""

    seconds: float  # model time: roll back, decode, draw
    sessions: int   # sessions whose tokens the call decoded
    tokens: int     # tokens it decoded, catch-up after commits and prompts included
    drafted: int    # tokens drawn
    paused: int     # positions where the draft proposed nothing (p_min)


def plan_works(session: DraftSession, rounds: list[Round]) -> list[Work]:
    """The Work of each of `rounds`, chosen for the session's next decode (duo.draft.value.with_riders):
    its chain's next token, its branch's, or both, each on its own sequence."""
    session.take(rounds)
    chain = list(session.chain)
    when = {"epoch": session.epoch, "commits": session.commits, "chain_len": len(chain)}
    works = []
    for chosen in rounds:
        fork, growing = chosen.fork, chosen.growing
        if fork is None:
            works.append(Work(session, chain, **when))
        elif growing is not None:
            works.append(Work(session, chain[:fork] + growing.tokens, fork=fork, growing=growing, **when))
        else:
            doubt = session.doubts[fork]
            works.append(Work(session, chain[:fork] + [doubt.alternative], fork=fork, doubt=doubt, **when))
    return works


class DraftCache:
    """One llama context for every session: a session's sequences form a Slot, and all of them together
    hold at most `cells` KV cells. The free slots belong to the event loop, the rest to the model thread."""

    def __init__(self, context: Context, cells: int, slots: int, branches: bool) -> None:
        self.context = context
        self.cells = cells
        per_slot = 2 if branches else 1
        self.free = [Slot(i * per_slot, i * per_slot + 1 if branches else None) for i in reversed(range(slots))]
        self.cells_used = 0
        self._held: dict[int, int] = {}  # a slot's chain sequence -> cells its session holds

    def take_slot(self) -> Slot:
        if not self.free:
            raise ModelError("every slot of the draft's KV cache is taken (duo-draft --max-sessions)")
        return self.free.pop()

    def give_back(self, slot: Slot) -> None:
        """Make `slot` free for another session. Call it right before queueing release() on the model
        thread, which runs its calls in order: the next owner's first round comes after the release."""
        self.free.append(slot)

    def release(self, session: DraftSession) -> None:
        """Forget a closed session's sequences, freeing their cells (model thread)."""
        for seq in (session.slot.chain, session.slot.branch):
            if seq is not None:
                self.context.clear(seq)
        self.cells_used -= self._held.pop(session.slot.chain, 0)

    def close(self) -> None:
        self.context.close()

    def run(self, works: Sequence[Work]) -> tuple[list[Step], RoundReport]:
        """Each work's Step, from one decode of every work's catch-up tokens (model thread)."""
        began = time.perf_counter()
        steps = [Step() for _ in works]
        parts: dict[int, Part] = {}
        for i, work in enumerate(works):
            if work.session.closed:
                continue  # closed meanwhile: its release waits behind this call
            try:
                parts[i] = self._prepare(work)
            except Exception as error:  # whatever it is, it concerns this session alone
                steps[i] = Step(error=error)
        fitted = self._fit(parts, steps)
        logits = self._decode(works, fitted, steps)
        for i, row in logits.items():
            steps[i] = draw_step(works[i], row)
        decoded = sum(len(part.tokens) for part in fitted.values())
        sessions = len({works[i].session.session_id for i in fitted})  # a chain and its branch: one session
        report = RoundReport(time.perf_counter() - began, sessions, decoded,
                             sum(step.drawn is not None for step in steps), sum(step.paused for step in steps))
        return steps, report

    def _prepare(self, work: Work) -> Part:
        """Roll the work's sequence back to where it agrees with work.tokens, and return the part that
        decodes the rest: at least the last token, for fresh logits.

        A branch sequence that holds another branch first takes the chain's prefix up to the fork: no
        recompute, the cells are shared (duo.model.Context.fork). A branch keeps what it decoded, so
        growing it decodes one token a round, as the chain does.
        """
        session, want, seq = work.session, work.tokens, work.seq
        if work.fork is None and not session.kv_tokens:
            # A new session starts from the longest prefix of its tokens that any sequence holds (another
            # session's system prompt, say): no recompute. Its cells count as this session's own too, which
            # errs on the safe side of --kv-cells.
            session.kv_tokens = want[:self.context.adopt_prefix(seq, want[:-1])]
        if work.fork is not None and common_prefix_length(session.branch_kv, want) < work.fork:
            self.context.fork(seq, work.fork, source=session.slot.chain)
            session.branch_kv = want[:self.context.past(seq)]
            session.branch_shared = len(session.branch_kv)
        cached = session.kv_tokens if work.fork is None else session.branch_kv
        keep = min(common_prefix_length(cached, want), len(want) - 1)
        self.context.rollback(keep, seq)
        del cached[keep:]
        # Cells of the branch's shared prefix that either sequence dropped are the branch's own now.
        session.branch_shared = min(session.branch_shared, keep)
        self._account(session)
        if len(want) > self.context.n_ctx:
            raise ModelError(f"the session outgrew the draft's context of {self.context.n_ctx} tokens; start "
                             "duo-draft with a larger --ctx-size")
        return Part(seq, keep, want[keep:])

    def _fit(self, parts: dict[int, Part], steps: list[Step]) -> dict[int, Part]:
        """The parts this round decodes, shortest first within n_batch tokens: a catch-up too long for
        what is left (a prompt, say) decodes its first tokens without logits and goes on next round, so
        it never holds back the others' tokens. A session whose tokens do not fit the free cells fails."""
        room, free = self.context.n_batch, self.cells - self.cells_used
        fitted = {}
        for i, part in sorted(parts.items(), key=lambda item: len(item[1].tokens)):
            n = min(len(part.tokens), room)
            if n > free:
                steps[i] = Step(error=ModelError(
                    f"the draft's KV cache is full ({self.cells} cells shared by all sessions, {free} free, "
                    f"{n} needed); start duo-draft with a larger --kv-cells"))
            elif n:
                fitted[i] = part if n == len(part.tokens) else Part(part.seq, part.pos, part.tokens[:n], logits_for=())
                room, free = room - n, free - n
        return fitted

    def _decode(self, works: Sequence[Work], fitted: dict[int, Part], steps: list[Step]) -> dict[int, np.ndarray]:
        """The last token's logits of each fitted part that asked for them, from one call; if llama.cpp
        refuses the call as a whole (no room for all of it at once), each part alone, so that only a
        part that fails alone fails its session."""
        if not fitted:
            return {}
        try:
            decoded = dict(zip(fitted, self.context.decode_parts(list(fitted.values()))))
        except ModelError:
            decoded = {}
            for i, part in fitted.items():
                try:
                    decoded[i] = self.context.decode_parts([part])[0]
                except ModelError as error:
                    steps[i] = Step(error=error)
        for i in decoded:
            self._decoded(works[i], fitted[i])
        return {i: rows[-1] for i, rows in decoded.items() if len(rows)}

    def _decoded(self, work: Work, part: Part) -> None:
        session = work.session
        (session.kv_tokens if work.fork is None else session.branch_kv).extend(part.tokens)
        self._account(session)

    def _account(self, session: DraftSession) -> None:
        """Count the cells `session` holds now; a running total, so that a metrics scrape reads one int."""
        held = session.cells_held()
        self.cells_used += held - self._held.get(session.slot.chain, 0)
        self._held[session.slot.chain] = held


def draw_step(work: Work, logits: np.ndarray) -> Step:
    """Draw the work's token from its logits, or pause the chain where the draft is too unsure (p_min)."""
    session = work.session
    try:
        if session.penalties.active or session.cursor is not None:
            output = work.tokens[session.output_start:]  # what the output's penalties and grammar look at
            if session.penalties.active:
                session.penalties.apply(logits, output)
            if session.cursor is not None and not constrain(work, output, logits):
                return Step(paused=True)
        if work.fork is None and not proposes(logits, session.p_min):
            return Step(paused=True)
        return Step(drawn=draw(session, logits, len(work.tokens)))
    except Exception as error:  # whatever it is, it concerns this session alone
        return Step(error=error)


def constrain(work: Work, output: list[int], logits: np.ndarray) -> bool:
    """Mask `logits` (in place) with the session's grammar after the work's `output`, so that the draft drafts only
    what the target's mask allows: a draft outside it would only be rejected. False where the tokens end with an
    end of generation (a branch the target took as its chain can): nothing follows it, the chain pauses."""
    session = work.session
    if work.fork is not None and session.branch_cursor is None:
        session.branch_cursor = session.cursor.copy()
    cursor = session.cursor if work.fork is None else session.branch_cursor
    if not cursor.move_to(output):
        at = session.output_start + len(cursor.tokens)
        if work.tokens[at] in cursor.ends:
            return False
        raise GrammarError(f"the session's {'chain' if work.fork is None else f'branch at {work.fork}'} breaks its "
                           f"grammar at position {at} (token {work.tokens[at]}; {session.committed} committed)")
    cursor.mask(logits)
    return True
