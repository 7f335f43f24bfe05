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
from duo.draft.confidence import softmax_scale
from duo.draft.session import DraftSession, Drawn, Slot, draw, proposes
from duo.draft.value import Round
from duo.llama.model import ModelError
from duo.llama.context import Context, Part, common_prefix_length
from duo.llama.parking import Parking


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
    confidences: tuple[float, ...] = ()  # per drawn token: the draft model's probability of it (duo.draft.confidence)
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

    def __init__(self, context: Context, cells: int, slots: int, branches: bool, parking: Parking | None = None) -> None:
        """`parking`: where closed sessions' chains wait for their conversation's next turn while other sessions run
        (duo.llama.parking; None: in the cache, until another session needs their room)."""
        self.context = context
        self.parking = parking
        self.cells = cells
        per_slot = 2 if branches else 1
        self.free = [Slot(i * per_slot, i * per_slot + 1 if branches else None) for i in reversed(range(slots))]
        self.cells_used = 0
        self._held: dict[int, int] = {}  # a slot's chain sequence -> cells its session holds
        self._left: dict[int, int] = {}   # a chain sequence whose closed session's cells stay -> its window's offset
        self._scratch = np.empty(0, np.float32)  # one row's softmax terms, for each drawn token's confidence

    def take_slot(self) -> Slot:
        if not self.free:
            raise ModelError("every slot of the draft's KV cache is taken (duo-draft --max-sessions)")
        return self.free.pop()

    def give_back(self, slot: Slot) -> None:
        """Make `slot` free for another session. Call it right before queueing release() on the model
        thread, which runs its calls in order: the next owner's first round comes after the release."""
        self.free.append(slot)

    def release(self, session: DraftSession) -> None:
        """Forget a closed session's branches (model thread). Its chain's cells stay, no longer counted as used, for
        the next turn of its conversation, whose prompt extends the sequence (adopt_prefix in _prepare), until
        another session needs their room (_fit)."""
        if session.slot.branch is not None:
            self.context.clear(session.slot.branch)
        self.cells_used -= self._held.pop(session.slot.chain, 0)
        self._left[session.slot.chain] = session.offset

    def _cells_left(self) -> int:
        return sum(self.context.past(seq) for seq in self._left)

    def _forget_left(self) -> None:
        """Free the cells closed sessions left (model thread)."""
        for seq in self._left:
            self.context.clear(seq)
        self._left.clear()

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
            if self._scratch.shape != rows.shape[1:]:
                self._scratch = np.empty(rows.shape[1:], np.float32)
            steps[i] = draw_step(works[i], rows, self._scratch)
        decoded = sum(len(part.tokens) for part in fitted.values())
        sessions = len({works[i].session.session_id for i in fitted})  # a chain and its branch: one session
        report = RoundReport(time.perf_counter() - began, sessions, decoded, sum(len(step.drawn) for step in steps),
                             sum(step.paused for step in steps), sum(step.guessed for step in steps),
                             sum(step.kept for step in steps))
        return steps, report

    def _prepare(self, work: Work) -> Part:
        """Roll the work's sequence back to where it agrees with work.tokens (as its window views them:
        duo.draft.window), and return the part that decodes the rest: at least the last token, for fresh logits.

        A branch sequence that holds another branch first takes the chain's prefix up to the fork: no
        recompute, the cells are shared (duo.llama.context.Context.fork). A branch keeps what it decoded, so
        growing it decodes one token a round, as the chain does.
        """
        session, seq = work.session, work.seq
        if work.fork is None and not session.kv_tokens:
            self._adopt(session, work)
        self._left.pop(session.slot.chain, None)  # the slot's cells are its session's now
        self._slide(session, work.chain_len)
        want = session.window.view(work.tokens, session.offset)
        fork = None if work.fork is None else session.window.kv_position(work.fork, session.offset)
        if fork is not None and common_prefix_length(session.branch_kv, want) < fork:
            self.context.fork(seq, fork, source=session.slot.chain)
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
                             "duo-draft with a larger --ctx-size or a --window")
        return Part(seq, keep, want[keep:])

    def _adopt(self, session: DraftSession, work: Work) -> None:
        """Start a new session (or one whose window was forgotten) from the longest prefix of its tokens that any
        sequence holds (another session's system prompt, say, or the previous turn's sequence): no recompute. Its
        cells count as this session's own too, which errs on the safe side of --kv-cells.

        A previous turn's cells hold its window as its offset placed it: the new session takes that offset where it
        finds more there (its window then moves on by a shift, _slide) than under its own."""
        window, held = session.window, self.context.held
        self._park_left(session.slot.chain)  # first: their cells are free for the run of cells a restore needs
        parked = self.parking.entries if self.parking is not None else []
        offsets = {window.offset_for(work.chain_len), *(offset for offset in [*self._left.values(),
                                                                              *(entry.tag for entry in parked)]
                                                         if offset <= window.offset_for(work.chain_len))}

        def reach(offset: int) -> int:
            view = window.view(work.tokens[:-1], offset)
            found = max([common_prefix_length(held(seq), view) for seq in range(self.context.n_seq)]
                        + [common_prefix_length(entry.tokens, view) for entry in parked])
            return window.chain_position(found, offset) if found > window.sink else found

        session.offset = max(sorted(offsets, reverse=True), key=reach)  # among equals the latest: less to shift
        session.kv_tokens = window.view(work.tokens, session.offset)
        chain, view = session.slot.chain, session.kv_tokens[:-1]
        if self.parking is None:
            adopted = self.context.adopt_prefix(chain, view)
        else:  # the slot's last session's cells, where they are another conversation's, parked at their own offset
            adopted = self.parking.adopt(chain, view, tag=self._left.get(chain, 0))
        del session.kv_tokens[adopted:]
        self._account(session)

    def _park_left(self, taken: int) -> None:
        """Move the cells closed sessions left, but on sequence `taken`, to the parking (model thread): there they
        slow no running session's tokens (duo.llama.parking)."""
        if self.parking is None:
            return
        idle = [seq for seq in self._left if seq != taken]
        self.parking.park(idle, tags=self._left)
        for seq in idle:
            del self._left[seq]

    def _slide(self, session: DraftSession, chain_len: int) -> None:
        """Move the session's window to where a chain of `chain_len` tokens puts it (duo.draft.window): drop the
        oldest grid steps after the sink and shift the rest down (llama.cpp's K-shift: no recompute), or, where the
        cells cannot shift (another sequence shares them), forget them and read the window again.
        Its branch sequence starts over from the chain (a fork: no recompute): a shift would move shared cells."""
        offset = session.window.offset_for(chain_len, session.offset)
        if offset == session.offset:
            return
        if session.slot.branch is not None:
            self.context.clear(session.slot.branch)
            session.branch_kv, session.branch_shared = [], 0
        drop = offset - session.offset
        if drop < 0 or not self.context.drop(session.slot.chain, session.window.sink, drop):
            self.context.clear(session.slot.chain)
        session.kv_tokens = list(self.context.held(session.slot.chain))
        session.offset = offset
        self._account(session)

    def _fit(self, works: Sequence[Work], parts: dict[int, Part], steps: list[Step]) -> dict[int, Part]:
        """The parts this round decodes, shortest first within n_batch tokens: a catch-up too long for
        what is left (a prompt, say) decodes its first tokens without logits and goes on next round, so
        it never holds back the others' tokens. A session whose tokens do not fit the free cells fails.
        A work's guess rides along, whole, where it fits what is left."""
        room, free = self.context.n_batch, self.cells - self.cells_used - self._cells_left()
        fitted = {}
        for i, part in sorted(parts.items(), key=lambda item: len(item[1].tokens)):
            n = min(len(part.tokens), room)
            if n > free and self._left:
                free += self._cells_left()
                self._forget_left()
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


def draw_step(work: Work, rows: np.ndarray, scratch: np.ndarray | None = None) -> Step:
    """Draw the work's token from its last token's logits (the first row), or pause the chain where the draft is
    too unsure (p_min). Rows after the first are the guess's (duo.draft.guess): where the draw equals the guessed
    token, the next row, computed after it, is the next position's; the first draw that differs ends the step (a
    guess holds no end of generation: nothing is drawn after one). `scratch`: a buffer a row's size for the
    confidences' softmax (duo.draft.confidence)."""
    guessed = len(rows) - 1
    drawn: list[Drawn] = []
    confidences: list[float] = []
    try:
        for j, logits in enumerate(rows):
            one = draw_one(work, j, logits, scratch)
            if one is None:
                break  # paused (p_min, or the grammar ended): a pause after drawn tokens is found again next round
            drawn.append(one[0])
            confidences.append(one[1])
            if j == guessed or one[0][0] != work.guess[j]:
                break
    except Exception as error:  # whatever it is, it concerns this session alone
        return Step(error=error)
    kept = common_prefix_length([token for token, _, _ in drawn], work.guess[:guessed])
    return Step(drawn=tuple(drawn), confidences=tuple(confidences), paused=not drawn, guessed=guessed, kept=kept)


def draw_one(work: Work, guessed: int, logits: np.ndarray,
             scratch: np.ndarray | None = None) -> tuple[Drawn, float] | None:
    """The token after the work's tokens and the guess's first `guessed` ones, with the draft model's probability
    of it at temperature 1 over the row as penalties and grammar leave it (what p_min reads: one softmax serves
    both); None where the chain pauses."""
    session = work.session
    if session.penalties.active or session.cursor is not None:
        tokens = work.tokens + list(work.guess[:guessed])
        allowed = None if session.cursor is None else grammar_mask(work, tokens)
        if session.cursor is not None and allowed is None:
            return None
        session.transform(logits, tokens, work.committed, allowed)
    scale = softmax_scale(logits, scratch)
    if work.fork is None and not proposes(logits, session.p_min, scale):
        return None
    drawn = draw(session, logits, len(work.tokens) + guessed, work.fork is None)
    return drawn, scale.probability(logits, drawn[0])


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
