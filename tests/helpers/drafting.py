"""Driving a draft by hand: a fixed extra cost, one drafting round, drafting until idle."""

from __future__ import annotations

from duo.draft.drafter import Drafter
from duo.draft.session import DraftSession
from duo.draft.value import RoundCost
from duo.llama.worker import ModelWorker
from duo.net._proto import duo_pb2 as pb


async def draft_once(drafter: Drafter, session: DraftSession) -> pb.DraftChunk | None:
    """One round for `session` alone: its chunk (None: nothing to send, or no round worth drafting); its
    error, raised."""
    drafted = await drafter.draft_round([session])
    if not drafted:
        return None
    [drafted] = drafted
    if drafted.error is not None:
        raise drafted.error
    return drafted.chunk


class FixedExtraCost(RoundCost):
    """A draft round cost where one more token adds `extra` to a decode of any size: a schedule that does not
    depend on timings, as RoundCost's measurements make it."""

    def __init__(self, extra: float) -> None:
        super().__init__()
        self.value = extra

    def extra(self, tokens: int) -> float:
        return self.value

    def observe(self, tokens: int, seconds: float) -> None:
        pass


async def draft_until_idle(drafter: Drafter, sessions: list[DraftSession],
                           max_rounds: int = 200) -> tuple[dict[int, list[pb.DraftChunk]], int]:
    """Rounds for `sessions` until none has work: each session's chunks, and the number of rounds; an
    error of any session is raised."""
    chunks: dict[int, list[pb.DraftChunk]] = {session.session_id: [] for session in sessions}
    for rounds in range(max_rounds):
        drafted = await drafter.draft_round(sessions)
        if not drafted:
            return chunks, rounds
        for result in drafted:
            if result.error is not None:
                raise result.error
            if result.chunk is not None:
                chunks[result.session.session_id].append(result.chunk)
    raise AssertionError(f"still drafting after {max_rounds} rounds")


# What one more token adds to a decode: nothing, so every round a session offers rides (duo.draft.value.
# with_riders). Its schedule then depends on its own values alone, not on the timings or the other sessions
# of a batched decode, and a batched round must draft for it what it drafts alone.
RIDE_COST = 0.0


def drafter_for(model, **settings) -> Drafter:
    """A Drafter whose sessions' schedules depend on their own values alone (RIDE_COST), as the comparisons need."""
    drafter = Drafter(model, ModelWorker(), **settings)
    drafter.round_cost = FixedExtraCost(RIDE_COST)
    return drafter
