"""A windowed draft (duo-draft --window): a session's KV holds its first tokens and its last W, whatever its length;
chain positions map to KV positions through commits, rejections, branches and the window's moves; a session may
outgrow --ctx-size; a later turn reuses the cells; the output through duo is the target's own."""

from __future__ import annotations

import asyncio

import llama_cpp
import pytest

from duo.draft.drafter import Drafter, InvalidEvent
from duo.draft.session import DraftSession
from duo.draft.window import Window
from duo.llama.context import Context
from duo.net._proto import duo_pb2 as pb
from helpers.drafting import draft_until_idle, drafter_for
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.processes import generate, start, wait_for_draft

WINDOW = Window(size=64, sink=4)
CTX_SIZE = 1024  # the draft's --ctx-size: room for a window of 64, a batch after it, and no more
CODE = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, item):\n"
        "        self.items.append(item)\n\n")


def code_tokens(model, n: int) -> list[int]:
    """`n` tokens of Python source, repeated as need be."""
    tokens = model.tokenize(CODE, add_special=False)
    return (tokens * (n // len(tokens) + 1))[:n]


class Reads:
    """Counts the tokens the draft's rounds decode (duo.draft.drafter.DraftObserver)."""

    def __init__(self) -> None:
        self.tokens = 0

    def on_round(self, report) -> None:
        self.tokens += report.tokens


def windowed(model, **settings) -> Drafter:
    return drafter_for(model, n_ctx=CTX_SIZE, top_k_cap=10, window=WINDOW, **settings)


def assert_kv_holds_the_window(drafter: Drafter, session: DraftSession) -> None:
    """The chain's sequence holds the window's view of the chain (its first tokens, then its last ones), at the KV
    positions llama.cpp has them at; the branch sequence shares the chain's cells it says it shares."""
    context = drafter.cache.context
    held = list(context.held(session.slot.chain))
    assert held == session.kv_tokens
    assert held == WINDOW.view(session.chain, session.offset)[:len(held)]
    assert len(held) <= WINDOW.cells + 1  # the view, and at most the token drafted after it
    assert llama_positions(context, session.slot.chain) == (0, len(held) - 1)
    if session.slot.branch is not None and context.past(session.slot.branch):
        branch_held = list(context.held(session.slot.branch))
        assert branch_held == session.branch_kv and branch_held[:session.branch_shared] == held[:session.branch_shared]
        assert llama_positions(context, session.slot.branch) == (0, len(branch_held) - 1)


def llama_positions(context: Context, seq: int) -> tuple[int, int]:
    """The first and last position llama.cpp's memory holds for `seq`."""
    memory = context._ctx.memory
    return llama_cpp.llama_memory_seq_pos_min(memory, seq), llama_cpp.llama_memory_seq_pos_max(memory, seq)


def test_the_window_moves_half_a_window_at_a_time_and_never_back_for_a_rejection():
    assert [WINDOW.offset_for(length) for length in (68, 69, 100, 101, 132, 133)] == [0, 32, 32, 64, 64, 96]
    assert WINDOW.offset_for(99, current=64) == 64  # a rejection shortened the chain: the window stays
    assert WINDOW.view(list(range(200)), 128) == [0, 1, 2, 3] + list(range(132, 200))
    assert WINDOW.kv_position(150, 128) == 22 and WINDOW.chain_position(22, 128) == 150


def test_a_lead_beyond_half_the_window_is_refused_with_what_to_change(draft_model):
    async def run() -> str:
        drafter = windowed(draft_model)
        with pytest.raises(InvalidEvent) as refused:
            await drafter.open(pb.OpenSession(session_id=1, committed=[11] * 10, max_ahead=WINDOW.grid + 1))
        return str(refused.value)

    assert "--window" in asyncio.run(run())


def test_a_session_longer_than_its_window_drafts_with_a_kv_of_at_most_the_window(draft_model):
    async def run() -> tuple[int, list[int]]:
        drafter = windowed(draft_model)
        drafter.observer = reads = Reads()
        session = await drafter.open(pb.OpenSession(session_id=1, committed=code_tokens(draft_model, 600),
                                                    max_ahead=8))
        await draft_until_idle(drafter, [session])
        prompt_read, cells = reads.tokens, []
        for _ in range(40):  # 80 committed tokens: the window moves on twice or more
            drafter.commit(session, session.committed, [session.chain[session.committed], 11])
            await draft_until_idle(drafter, [session])
            assert_kv_holds_the_window(drafter, session)
            cells.append(drafter.cells_used)
        await drafter.close(session)
        await drafter.stop()
        return prompt_read, cells

    prompt_read, cells = asyncio.run(run())
    assert prompt_read <= WINDOW.cells + 8  # the window and the drafts after it, not the 600 tokens
    assert max(cells) <= WINDOW.cells + 1


def test_chain_positions_map_through_commits_rejections_branches_and_shifts(draft_model, monkeypatch):
    shifts = []
    drop = Context.drop

    def counted(context: Context, seq: int, start: int, n: int) -> bool:
        shifted = drop(context, seq, start, n)
        shifts.append(shifted)
        return shifted

    monkeypatch.setattr(Context, "drop", counted)

    async def run() -> dict[str, int]:
        drafter = windowed(draft_model, max_branches=2, branch_len=2)
        session = await drafter.open(pb.OpenSession(session_id=1, committed=code_tokens(draft_model, 300),
                                                    max_ahead=8))
        seen = {"branches after a shift": 0, "branches taken": 0, "rejections": 0}
        for turn in range(60):
            chunks, _ = await draft_until_idle(drafter, [session])
            assert_kv_holds_the_window(drafter, session)
            if any(shifts) and any(chunk.HasField("branch_of") for chunk in chunks[1]):
                seen["branches after a shift"] += 1
            taken = next((branch for branch in session.branches if branch.fork == session.committed), None)
            if taken is not None and turn % 3 == 0:
                drafter.commit(session, session.committed, taken.tokens[:2])  # the target took the branch
                seen["branches taken"] += 1
            elif turn % 2:
                drafter.commit(session, session.committed, session.chain[session.committed:session.committed + 3])
            else:
                drafted = session.chain[session.committed]
                drafter.commit(session, session.committed, [drafted + 1])  # a rejection
                seen["rejections"] += 1
        assert_kv_holds_the_window(drafter, session)
        await drafter.close(session)
        await drafter.stop()
        return seen

    seen = asyncio.run(run())
    assert sum(shifts) >= 2, "the window never moved by a shift"
    assert all(seen.values()), seen


def test_a_session_longer_than_the_drafts_ctx_size_is_served(draft_model):
    async def run() -> list[pb.DraftChunk]:
        drafter = windowed(draft_model)
        session = await drafter.open(pb.OpenSession(session_id=1, committed=code_tokens(draft_model, CTX_SIZE + 300),
                                                    max_ahead=6))
        chunks, _ = await draft_until_idle(drafter, [session])
        drafter.commit(session, session.committed, session.chain[session.committed:] + [11])
        more, _ = await draft_until_idle(drafter, [session])
        await drafter.close(session)
        await drafter.stop()
        return chunks[1] + more[1]

    chunks = asyncio.run(run())
    assert [chunk.start for chunk in chunks if chunk.tokens][0] == CTX_SIZE + 300
    assert sum(len(chunk.tokens) for chunk in chunks) >= 2


async def next_turn(drafter: Drafter, reads: Reads, answered: list[int], message: list[int]) -> int:
    """A conversation's next turn (its answer so far, then `message`) drafted until idle, its KV checked: the tokens
    the draft read for it."""
    reads.tokens = 0
    session = await drafter.open(pb.OpenSession(session_id=99, committed=answered + message, max_ahead=8))
    await draft_until_idle(drafter, [session])
    assert_kv_holds_the_window(drafter, session)
    await drafter.close(session)
    return reads.tokens


@pytest.mark.parametrize("new_tokens", [10, 40], ids=["within a grid step", "past the next grid step"])
def test_a_second_turn_reuses_the_cells_of_the_first(draft_model, new_tokens):
    """The next turn's prompt is the last one's sequence and a new message: the draft reads the message, not the
    window again, whether the window stays put or moves on (a shift) for it."""
    async def run() -> int:
        drafter = windowed(draft_model)
        drafter.observer = reads = Reads()
        first = await drafter.open(pb.OpenSession(session_id=1, committed=code_tokens(draft_model, 500), max_ahead=8))
        await draft_until_idle(drafter, [first])
        drafter.commit(first, first.committed, first.chain[first.committed:first.committed + 4] + [11])
        await draft_until_idle(drafter, [first])
        answered = first.chain[:first.committed]
        await drafter.close(first)
        read = await next_turn(drafter, reads, answered, code_tokens(draft_model, new_tokens + 7)[7:])
        await drafter.stop()
        return read

    read = asyncio.run(run())
    assert read <= new_tokens + 8 + 1 < WINDOW.size  # the message, the drafts after it (and the answer's last token)


@pytest.mark.parametrize("new_tokens", [10, 40], ids=["within a grid step", "past the next grid step"])
@pytest.mark.parametrize("cache_ram", [8192, 0], ids=["parked", "kept in the cache"])
def test_another_conversation_runs_with_the_closed_ones_cells_parked_and_its_next_turn_restores_them(draft_model,
                                                                                                    cache_ram,
                                                                                                    new_tokens):
    """A closed session's chain waits in host memory (duo.llama.parking) while another conversation's session runs,
    out of the cells that session's tokens read (even where that session takes its slot); the next turn finds it
    there, at its window's offset, and reads only its new message. With --cache-ram 0 the other session took the
    slot's cells: the next turn reads its window again."""
    async def run() -> tuple[int, int, int]:
        drafter = windowed(draft_model, cache_ram=cache_ram)
        drafter.observer = reads = Reads()
        # Tokens that never repeat: a window at another offset cannot find them by chance.
        unique = [(7 * i) % 900 + 100 for i in range(500)]
        first = await drafter.open(pb.OpenSession(session_id=1, committed=unique, max_ahead=8))
        await draft_until_idle(drafter, [first])
        answered = first.chain[:first.committed]
        await drafter.close(first)
        other = await drafter.open(pb.OpenSession(session_id=2, committed=[5, 6, 7, 8, 9] * 8, max_ahead=8))
        await draft_until_idle(drafter, [other])
        context = drafter.cache.context
        idle_cells = sum(context.past(seq) for seq in range(context.n_seq)) - context.past(other.slot.chain)
        await drafter.close(other)
        read = await next_turn(drafter, reads, answered, code_tokens(draft_model, new_tokens + 7)[7:])
        restored = drafter.cache.parking.restored if drafter.cache.parking else 0
        await drafter.stop()
        return idle_cells, read, restored

    idle_cells, read, restored = asyncio.run(run())
    assert idle_cells == 0 and restored == (1 if cache_ram else 0)
    if cache_ram:
        assert read <= new_tokens + 8 + 1 < WINDOW.size  # the message and the drafts after it (at its own offset)
    else:  # the other session took the first's slot, and its cells with it: the window is read again
        assert read > WINDOW.size - new_tokens


def test_greedy_output_through_duo_with_a_windowed_draft_is_the_targets_own(tiny_target, tiny_draft, target_model,
                                                                          process_logs):
    """A prompt of 1500 tokens, 12 times the window and longer than the draft's --ctx-size: the draft serves it
    (its drafts are accepted; the target's own context lookup is off, so that every draft is the draft's) and the
    output is the target's greedy continuation."""
    draft = start("duo.cli.draft", ["--model", str(tiny_draft), "--ctx-size", str(CTX_SIZE), "--window", "128"],
                  process_logs)
    target = start("duo.cli.target", ["--model", str(tiny_target), "--ctx-size", "2048", "--peer", draft.address,
                                      "--sync", "4", "--no-lookup"], process_logs)
    try:
        wait_for_draft(target.address)
        prompt = target_model.detokenize(code_tokens(target_model, 1500)).decode()
        tokens, last = generate(target.address, prompt, max_tokens=48, timeout=300)
    finally:
        target.stop()
        draft.stop()
    assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, tokens, 48)
    assert last.stats.draft_tokens_accepted > 0, "the draft took no part"
