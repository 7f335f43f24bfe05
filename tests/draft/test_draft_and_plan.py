"""The draft's chain bookkeeping and --draft-p-min; the target's batch plan under --draft-max/--draft-min."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from duo.net._proto import duo_pb2 as pb
from duo.costs import StepCosts
from duo.draft.drafter import Drafter
from duo.llama.worker import ModelWorker
from duo.sampling.params import SamplingParams
from duo.target.batching import StepBatcher
from duo.target.generation import Generation
from duo.target.policy import StepPlan
from duo.target.request import Request, SpecSettings
from helpers.drafting import draft_once
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie


async def open_session(drafter: Drafter, prompt: list[int], p_min: float = 0.0, max_ahead: int = 8):
    return await drafter.open(pb.OpenSession(session_id=1, committed=prompt, max_ahead=max_ahead, p_min=p_min))


def test_the_draft_streams_tokens_that_continue_its_chain(draft_model):
    async def run():
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=256, top_k_cap=10)
        session = await open_session(drafter, [9707, 11, 1879])
        chunks = [await draft_once(drafter, session) for _ in range(3)]
        await drafter.close(session)
        await drafter.stop()
        return chunks

    chunks = asyncio.run(run())
    assert [c.start for c in chunks] == [3, 4, 5] and all(c.epoch == 0 and len(c.tokens) == 1 for c in chunks)
    assert all(not c.dists for c in chunks)  # greedy: no distributions on the wire


def test_draft_p_min_pauses_the_chain_at_a_doubtful_position_until_the_next_commit(draft_model):
    async def run():
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=256, top_k_cap=10)
        session = await open_session(drafter, [9707, 11, 1879], p_min=0.999999)
        chunk = await draft_once(drafter, session)
        paused = session.paused and not session.wants_to_draft()
        session.apply_commit(3, [279])
        resumed = session.wants_to_draft()
        await drafter.close(session)
        await drafter.stop()
        return chunk, paused, resumed

    chunk, paused, resumed = asyncio.run(run())
    assert paused and resumed
    assert chunk.paused and not chunk.tokens and (chunk.epoch, chunk.start) == (0, 3)  # the target need not wait


def test_a_commit_that_agrees_keeps_the_chain_and_its_epoch(draft_model):
    async def run():
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=256, top_k_cap=10)
        session = await open_session(drafter, [9707, 11, 1879])
        for _ in range(3):
            await draft_once(drafter, session)
        chain = list(session.chain)
        session.apply_commit(3, chain[3:5])  # the target accepted two drafts
        kept = (session.chain == chain, session.epoch, session.committed)
        session.apply_commit(5, [chain[5] + 1])  # ... then disagreed with the third
        restarted = (session.chain == chain[:5] + [chain[5] + 1], session.epoch, session.committed)
        await drafter.close(session)
        await drafter.stop()
        return kept, restarted

    kept, restarted = asyncio.run(run())
    assert kept == (True, 0, 5)
    assert restarted == (True, 1, 6)


def test_a_commit_that_overtakes_the_chain_starts_a_new_epoch_at_its_end(draft_model):
    async def run():
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=256, top_k_cap=10)
        session = await open_session(drafter, [9707, 11, 1879])
        session.apply_commit(3, [5, 6])
        chunk = await draft_once(drafter, session)
        await drafter.close(session)
        await drafter.stop()
        return chunk

    chunk = asyncio.run(run())
    assert chunk.epoch == 1 and chunk.start == 5


def test_max_ahead_bounds_how_far_the_draft_runs(draft_model):
    async def run():
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=256, top_k_cap=10)
        session = await open_session(drafter, [9707, 11, 1879], max_ahead=2)
        for _ in range(2):
            await draft_once(drafter, session)
        full = session.wants_to_draft()
        session.apply_commit(3, session.chain[3:4])
        room_again = session.wants_to_draft()
        session.max_ahead = 0  # the target's policy lets the draft rest
        resting = session.wants_to_draft()
        await drafter.close(session)
        await drafter.stop()
        return full, room_again, resting

    assert asyncio.run(run()) == (False, True, False)


def plan_for(pending: int, **settings) -> tuple[int, int]:
    """(drafts in the batch, drafts verified) for a generation holding `pending` chain tokens, as the
    target's batched call plans it."""
    generation = Generation(1, Request([1, 2, 3], SamplingParams()), model=None, settings=SpecSettings(**settings))
    generation.chain.receive(0, 3, list(range(100, 100 + pending)), [])
    batcher = StepBatcher(ModelWorker(), SimpleNamespace(n_seq=1, n_batch=512), StepCosts())
    work = asyncio.run(generation.verify_work(0, room=1000, plan=StepPlan(None, chain=True)))  # not adaptive
    [planned] = batcher._plan([(work, None)])
    tokens = list(planned.part.tokens)
    assert tokens[0] == 3 and list(planned.part.outputs()) == list(range(len(tokens)))  # the newest committed token leads
    return len(tokens) - 1, len(planned.drafts)


def test_draft_max_caps_the_batch_and_the_next_draft_is_checked_by_the_last_row():
    assert plan_for(6, draft_max=4, adaptive=False) == (4, 5)
    assert plan_for(3, draft_max=4, adaptive=False) == (3, 3)


def test_below_draft_min_the_target_decodes_alone():
    assert plan_for(2, draft_max=4, draft_min=3, adaptive=False) == (0, 1)
    assert plan_for(3, draft_max=4, draft_min=3, adaptive=False) == (3, 3)


def test_with_no_drafts_the_target_decodes_alone():
    assert plan_for(0, draft_max=4, adaptive=False) == (0, 0)


def test_after_a_partial_acceptance_the_draft_proposes_what_a_fresh_decode_of_the_commit_gives(draft_model):
    """The draft's cache holds six drafted tokens; the target accepts two and corrects the third. What the
    draft proposes next must be its own greedy continuation of the committed tokens, as a fresh context
    decodes it: a rollback that left the rejected tokens' cells behind would change those logits."""
    prompt = [9707, 11, 1879]

    async def run() -> tuple[list[int], list[int], int]:
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=256, top_k_cap=10)
        session = await open_session(drafter, prompt, max_ahead=6)
        for _ in range(6):
            await draft_once(drafter, session)
        drafted = list(session.chain[len(prompt):])
        correction = next(token for token in range(100, 200) if token != drafted[2])
        committed = prompt + drafted[:2] + [correction]
        drafter.commit(session, len(prompt), committed[len(prompt):])
        after = []
        for _ in range(4):
            chunk = await draft_once(drafter, session)
            after += list(chunk.tokens)
        await drafter.close(session)
        await drafter.stop()
        return committed, after, len(drafted)

    committed, after, drafted = asyncio.run(run())
    assert drafted == 6 and len(after) == 4
    assert leaves_greedy_path_only_at_a_near_tie(draft_model, committed, after, 4), after
