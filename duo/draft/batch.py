"""The draft's batched step: one llama context holds every session's sequences, and one decode per round
drafts the next token of each work (a session's chain, its branch, or both), or, where the chain's work guesses from
the context (duo.draft.guess), the tokens its draws follow the guess for and the one after them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from duo.constraint import GrammarError
from duo.draft.branches import Branch, Doubt
from duo.draft.session import DraftSession, Drawn, Slot, draw, proposes
from duo.draft.value import Round
from duo.llama.model import Context, ModelError, Part, common_prefix_length


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
    guess: tuple[int, ...] = ()    # chain work: the context's guess of the tokens after `tokens` (duo.draft.guess)
    committed: int = 0             # the session's committed tokens when planned: tokens[:committed] stay as they are

    @property
    def seq(self) -> int:
        return self.session.slot.chain if self.fork is None else self.session.slot.branch


@dataclass(frozen=True)
class Step:
    """What a round made of one Work: the tokens drawn (one, or, after a guess of `guessed` tokens, those its draws
    followed and the one after them), a pause (the draft is too unsure: p_min), an error for its session alone, or
    none of these: its catch-up goes on next round (it did not fit the batch)."""

    drawn: tuple[Drawn, ...] = ()
    paused: bool = False
    error: Exception | None = None
    guessed: int = 0  # the guess's tokens decoded
    kept: int = 0     # the drawn tokens equal to the guess's first ones

    @property
    def missed(self) -> bool:
        """Whether a draw differed from the guessed token (not just a pause or an end of generation before it)."""
        return self.kept < self.guessed and len(self.drawn) > self.kept


@dataclass(frozen=True)
class RoundReport:
    """One round's model call, for the metrics."""

    seconds: float  # model time: roll back, decode, draw
    sessions: int   # sessions whose tokens the call decoded
    tokens: int     # tokens it decoded, catch-up after commits and prompts included
    drafted: int    # tokens drawn
    paused: int     # positions where the draft proposed nothing (p_min)
    guessed: int = 0  # guessed tokens decoded (duo.draft.guess)
    kept: int = 0     # of them, those the draws followed


def plan_works(session: DraftSession, rounds: list[Round]) -> list[Work]:
    """The Work of each of `rounds`, chosen for the session's next decode (duo.draft.value.with_riders):
    its chain's next token, its branch's, or both, each on its own sequence."""
    session.take(rounds)
    chain = list(session.chain)
    when = {"epoch": session.epoch, "commits": session.commits, "chain_len": len(chain), "committed": session.committed}
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
        fitted = self._fit(works, parts, steps)
        logits = self._decode(works, fitted, steps)
        for i, rows in logits.items():
            steps[i] = draw_step(works[i], rows)
        decoded = sum(len(part.tokens) for part in fitted.values())
        sessions = len({works[i].session.session_id for i in fitted})  # a chain and its branch: one session
        report = RoundReport(time.perf_counter() - began, sessions, decoded, sum(len(step.drawn) for step in steps),
                             sum(step.paused for step in steps), sum(step.guessed for step in steps),
                             sum(step.kept for step in steps))
        return steps, report

    def _prepare(self, work: Work) -> Part:
        """Roll the work's sequence back to where it agrees with work.tokens, and return the part that
        decodes the rest: at least the last token, for fresh logits.

        A branch sequence that holds another branch first takes the chain's prefix up to the fork: no
        recompute, the cells are shared (duo.llama.model.Context.fork). A branch keeps what it decoded, so
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

    def _fit(self, works: Sequence[Work], parts: dict[int, Part], steps: list[Step]) -> dict[int, Part]:
        """The parts this round decodes, shortest first within n_batch tokens: a catch-up too long for
        what is left (a prompt, say) decodes its first tokens without logits and goes on next round, so
        it never holds back the others' tokens. A session whose tokens do not fit the free cells fails.
        A work's guess rides along, whole, where it fits what is left."""
        room, free = self.context.n_batch, self.cells - self.cells_used
        fitted = {}
        for i, part in sorted(parts.items(), key=lambda item: len(item[1].tokens)):
            n = min(len(part.tokens), room)
            if n > free:
                steps[i] = Step(error=ModelError(
                    f"the draft's KV cache is full ({self.cells} cells shared by all sessions, {free} free, "
                    f"{n} needed); start duo-draft with a larger --kv-cells"))
            elif n:
                if n < len(part.tokens):
                    part = Part(part.seq, part.pos, part.tokens[:n], logits_for=())
                elif works[i].guess and len(works[i].guess) <= min(room, free) - n:
                    part = with_guess(part, works[i].guess)
                fitted[i] = part
                room, free = room - len(part.tokens), free - len(part.tokens)
        return fitted

    def _decode(self, works: Sequence[Work], fitted: dict[int, Part], steps: list[Step]) -> dict[int, np.ndarray]:
        """The logits each fitted part asked for (its last token's, and its guess's), from one call; if llama.cpp
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
        return {i: rows for i, rows in decoded.items() if len(rows)}

    def _decoded(self, work: Work, part: Part) -> None:
        session = work.session
        (session.kv_tokens if work.fork is None else session.branch_kv).extend(part.tokens)
        self._account(session)

    def _account(self, session: DraftSession) -> None:
        """Count the cells `session` holds now; a running total, so that a metrics scrape reads one int."""
        held = session.cells_held()
        self.cells_used += held - self._held.get(session.slot.chain, 0)
        self._held[session.slot.chain] = held


def with_guess(part: Part, guess: Sequence[int]) -> Part:
    """`part` followed by the guessed tokens, with the logits of its last token and of each guessed one."""
    return Part(part.seq, part.pos, [*part.tokens, *guess], logits_for=range(len(part.tokens) - 1,
                                                                                len(part.tokens) + len(guess)))


def draw_step(work: Work, rows: np.ndarray) -> Step:
    """Draw the work's token from its last token's logits (the first row), or pause the chain where the draft is
    too unsure (p_min). Rows after the first are the guess's (duo.draft.guess): where the draw equals the guessed
    token, the next row, computed after it, is the next position's; the first draw that differs ends the step (a
    guess holds no end of generation: nothing is drawn after one)."""
    guessed = len(rows) - 1
    drawn: list[Drawn] = []
    try:
        for j, logits in enumerate(rows):
            one = draw_one(work, j, logits)
            if one is None:
                break  # paused (p_min, or the grammar ended): a pause after drawn tokens is found again next round
            drawn.append(one)
            if j == guessed or one[0] != work.guess[j]:
                break
    except Exception as error:  # whatever it is, it concerns this session alone
        return Step(error=error)
    kept = common_prefix_length([token for token, _, _ in drawn], work.guess[:guessed])
    return Step(drawn=tuple(drawn), paused=not drawn, guessed=guessed, kept=kept)


def draw_one(work: Work, guessed: int, logits: np.ndarray) -> Drawn | None:
    """The token after the work's tokens and the guess's first `guessed` ones, None where the chain pauses."""
    session = work.session
    if session.penalties.active or session.cursor is not None:
        tokens = work.tokens + list(work.guess[:guessed])
        allowed = None if session.cursor is None else grammar_mask(work, tokens)
        if session.cursor is not None and allowed is None:
            return None
        session.transform(logits, tokens, work.committed, allowed)
    if work.fork is None and not proposes(logits, session.p_min):
        return None
    return draw(session, logits, len(work.tokens) + guessed, work.fork is None)


def grammar_mask(work: Work, tokens: list[int]) -> np.ndarray | None:
    """The tokens the session's grammar allows after the output in `tokens`, so that the draft drafts only what the
    target's mask allows: a draft outside it would only be rejected. None where the tokens end with an end of
    generation (a branch the target took as its chain can): nothing follows it, the chain pauses."""
    session = work.session
    if work.fork is not None and session.branch_cursor is None:
        session.branch_cursor = session.cursor.copy()
    cursor = session.cursor if work.fork is None else session.branch_cursor
    if not cursor.move_to(tokens[session.output_start:]):
        at = session.output_start + len(cursor.tokens)
        if tokens[at] in cursor.ends:
            return None
        raise GrammarError(f"the session's {'chain' if work.fork is None else f'branch at {work.fork}'} breaks its "
                           f"grammar at position {at} (token {tokens[at]}; {session.committed} committed)")
    return cursor.allowed()
