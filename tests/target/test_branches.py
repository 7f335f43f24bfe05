"""The draft's branches: where they fork, what they assume, how a commit takes or drops them."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from duo.net._proto import duo_pb2 as pb
from duo.draft.batch import Step, Work, plan_works
from duo.draft.branches import Branch, Doubt, branch_length, doubt_of
from duo.draft.drafter import Drafter
from duo.draft.session import DraftSession, Slot
from duo.draft.value import Round
from duo.llama.worker import ModelWorker
from duo.sampling.distributions import SparseDist
from duo.sampling.params import SamplingParams
from helpers.drafting import FixedExtraCost, draft_until_idle

PROMPT = [9707, 11, 1879]


def test_a_greedy_doubt_offers_the_second_best_token():
    logits = np.array([0.0, 3.0, 2.5, -1.0], dtype=np.float32)
    doubt = doubt_of(logits, drawn=1, dist=SparseDist(np.array([1]), np.array([1.0])), greedy=True)
    assert doubt.alternative == 2 and doubt.margin == pytest.approx(0.5)


def test_a_sampled_doubt_offers_the_most_probable_other_token_the_draft_could_draw():
    dist = SparseDist(np.array([4, 2, 7]), np.array([0.5, 0.3, 0.2]))
    doubt = doubt_of(np.zeros(8, dtype=np.float32), drawn=4, dist=dist, greedy=False)
    assert doubt.alternative == 2 and doubt.dist is dist
    lone = SparseDist(np.array([4]), np.array([1.0]))  # top_k 1: nothing else was possible
    assert doubt_of(np.zeros(8, dtype=np.float32), drawn=4, dist=lone, greedy=False).alternative is None


def test_branches_run_at_most_the_draft_length_the_target_steers_for():
    assert branch_length(max_ahead=18, fixed=0) == 8  # max_ahead 2k + 2 for k = 8
    assert branch_length(max_ahead=6, fixed=0) == 2
    assert branch_length(max_ahead=0, fixed=0) == 0   # the draft rests: no branches either
    assert branch_length(max_ahead=10, fixed=3) == 3


def test_rounds_go_to_the_chain_first_then_to_a_doubtful_fork_before_a_far_lead():
    session = session_with_chain([7, 8], committed=2)  # max_ahead 8: the target prefers k = 3
    assert best_round(session).fork is None  # nothing drafted: the next step needs the chain
    sure, unsure = Doubt(8.0, 9, None), Doubt(-1.0, 9, None)  # the second: the draft's pick was not its argmax
    session.chain += [4, 5, 6, 1]
    session.doubts = {2: sure, 3: unsure, 4: sure, 5: sure}
    session.kv_tokens = session.chain[:-1]
    chosen = best_round(session)
    assert chosen.fork == 3 and chosen.growing is None  # worth more than a fifth chain token behind a doubt
    session.doubts[3] = sure
    assert best_round(session).fork is None  # no doubt left: the lead is worth more than any branch
    session.chain += [1, 2, 3, 4]  # max_ahead reached, every position sure: branches at the sure positions
    session.doubts.update({6: sure, 7: sure, 8: sure, 9: sure})
    session.kv_tokens = session.chain[:-1]
    assert best_round(session) is None  # worth less than a fiftieth of a token each: the draft idles


def test_a_new_fork_worth_more_than_the_growing_branch_ends_it():
    session, grown = growing_a_branch_with_a_doubt_after_it()
    chosen = best_round(session)
    assert chosen.fork == 4 and chosen.growing is None and grown.finished


def growing_a_branch_with_a_doubt_after_it() -> tuple[DraftSession, Branch]:
    """A session growing a doubtful branch at position 3, with the chain's doubt at 4 worth a new fork."""
    session = session_with_chain([7, 8, 4, 5, 6], committed=2)
    session.doubts = {2: Doubt(8.0, 9, None), 3: Doubt(8.0, 9, None), 4: Doubt(-2.0, 9, None)}
    session.kv_tokens = session.chain[:-1]
    grown = Branch(epoch=3, fork=3, tokens=[9, 1, 2], doubts=[None, Doubt(-2.0, 0, None), Doubt(-2.0, 0, None)])
    session.branches = [grown]
    return session, grown


def best_round(session: DraftSession) -> Round | None:
    """The round worth most, the one a decode holds for the session whatever the cost of a second; taken."""
    offered = session.offered_rounds()
    session.take(offered[:1])
    return offered[0] if offered else None


def test_a_new_fork_left_out_of_the_decode_leaves_the_growing_branch_growing():
    session, grown = growing_a_branch_with_a_doubt_after_it()
    offered = session.offered_rounds()
    assert offered[0].fork == 4 and offered[0].growing is None  # the new fork first, the lead beside it
    works = plan_works(session, [offered[1]])  # only the lead went in (the fork did not pay)
    assert [work.fork for work in works] == [None] and not grown.finished


def session_with_chain(chain: list[int], committed: int) -> DraftSession:
    return DraftSession(session_id=1, chain=chain, committed=committed, params=SamplingParams(),
                        rng=np.random.default_rng(0), max_ahead=8, p_min=0.0, slot=Slot(0, 1), n_ctx=256, max_branches=2,
                        next_epoch=3)


def test_a_commit_of_the_token_a_branch_assumed_makes_the_branch_the_chain():
    session = session_with_chain([7, 8, 4, 5, 6], committed=2)
    session.branches = [Branch(epoch=3, fork=3, tokens=[9, 1, 2], doubts=[None, None, None]),
                        Branch(epoch=4, fork=4, tokens=[1, 1], doubts=[None, None])]
    session.apply_commit(2, [4, 9])
    assert session.chain == [7, 8, 4, 9, 1, 2] and session.epoch == 3 and session.branches == []


def test_a_commit_no_branch_assumed_restarts_the_chain_under_an_epoch_never_used():
    session = session_with_chain([7, 8, 4, 5, 6], committed=2)
    session.branches = [Branch(epoch=3, fork=3, tokens=[9, 1], doubts=[None, None])]
    session.next_epoch = 4
    session.apply_commit(2, [4, 3])
    assert session.chain == [7, 8, 4, 3] and session.epoch == 4 and session.branches == []


def test_a_commit_that_agrees_with_the_chain_drops_the_branches_it_decided():
    session = session_with_chain([7, 8, 4, 5, 6], committed=2)
    session.branches = [Branch(epoch=3, fork=3, tokens=[9, 1], doubts=[None, None]),
                        Branch(epoch=4, fork=4, tokens=[2, 1], doubts=[None, None])]
    session.apply_commit(2, [4, 5])
    assert session.chain == [7, 8, 4, 5, 6] and [branch.epoch for branch in session.branches] == [4]


def test_in_spare_time_the_draft_branches_with_the_tokens_a_fresh_decode_gives(
        draft_model):
    async def run():
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=256, top_k_cap=10, max_branches=1, branch_len=2)
        session = await drafter.open(pb.OpenSession(session_id=1, committed=PROMPT, max_ahead=4))
        chunks, _ = await draft_until_idle(drafter, [session])
        await drafter.close(session)
        await drafter.stop()
        return session, chunks[1], drafter.round_cost

    session, chunks, cost = asyncio.run(run())
    assert cost.costs.measured_seconds(1) is not None  # the rounds timed, for riders to come
    # The chain up to max_ahead, and one branch of two drafts at a position the chain had drafted.
    assert [(c.epoch, c.start) for c in chunks if c.epoch == 0] == [(0, 3), (0, 4), (0, 5), (0, 6)]
    assert chunks[0].epoch == 0  # nothing before the chain's first draft
    first, second = [c for c in chunks if c.epoch != 0]
    fork = first.start
    assert chunks.index(first) > [(c.epoch, c.start) for c in chunks].index((0, fork))
    assert first.HasField("branch_of") and first.branch_of == session.epoch == 0
    assert first.tokens[0] == session.doubts[fork].alternative != session.chain[fork]
    assert first.epoch > session.epoch and second.epoch == first.epoch and not second.HasField("branch_of")
    assert second.start == fork + 2 and session.branches[0].finished  # the one branch is long enough
    # The branch's drafts are what the draft model gives after the chain's prefix and the assumed token.
    assert [first.tokens[1], second.tokens[0]] == greedy(draft_model, session.chain[:fork] + [first.tokens[0]], 2)


def test_one_decode_grows_the_chain_and_a_branch_when_a_second_token_is_cheap(draft_model):
    async def run():
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=256, top_k_cap=10, max_branches=1, branch_len=2)
        drafter.round_cost = FixedExtraCost(0.0)  # one more token adds nothing to a decode (a GPU, nearly)
        session = await drafter.open(pb.OpenSession(session_id=1, committed=PROMPT, max_ahead=6))
        rounds = []
        while drafted := await drafter.draft_round([session]):
            rounds.append([result.chunk for result in drafted if result.chunk is not None])
        await drafter.close(session)
        await drafter.stop()
        return session, rounds

    session, rounds = asyncio.run(run())
    both = [chunks for chunks in rounds if len(chunks) == 2]
    assert both, "no decode held the chain's lead and a branch"
    for chunks in both:
        assert sorted(c.epoch == session.epoch == 0 for c in chunks) == [False, True]
    chain = [c for chunks in rounds for c in chunks if c.epoch == 0]
    assert [c.start for c in chain] == list(range(3, 3 + 6)) and len(rounds) < 6 + 3  # rounds shared
    # Both sequences' drafts are what a fresh decode gives: the chain's, and the branch's after its fork.
    branch = session.branches[0]
    expected_chain, expected_branch = greedy(draft_model, PROMPT, 6), greedy(
        draft_model, session.chain[:branch.fork] + branch.tokens[:1], len(branch.tokens) - 1)
    assert session.chain[3:] == expected_chain and branch.tokens[1:] == expected_branch


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """n tokens of a fresh greedy decode after `prompt`."""
    fresh = model.new_context(256)
    drawn: list[int] = []
    for _ in range(n):
        drawn.append(int(np.argmax(fresh.decode(prompt + drawn, 0)[-1])))
        fresh.rollback(0)
    fresh.close()
    return drawn


class NoEndModel:
    """What Drafter reads of its model to finish a round, for rounds made up by hand."""

    n_ctx_train = 256
    n_vocab = 100

    @staticmethod
    def is_end_of_generation(token: int) -> bool:
        return False


def branch_round(session: DraftSession) -> tuple[Drafter, Work]:
    drafter = Drafter(NoEndModel(), None, n_ctx=256, top_k_cap=10, max_branches=2, branch_len=2)
    work = plan_works(session, session.offered_rounds()[:1])[0]
    assert work is not None and work.fork is not None
    return drafter, work


def test_a_commit_that_agrees_with_the_chain_keeps_a_branch_round_forking_after_it():
    session = session_with_chain([7, 8, 4, 5, 6, 1, 2, 3, 4, 5, 6], committed=2)
    session.max_ahead = 6  # the chain is as far ahead as allowed: the next work is a branch
    session.kv_tokens = list(session.chain)
    session.doubts = {5: Doubt(0.1, 9, None), 3: Doubt(2.0, 8, None)}
    drafter, work = branch_round(session)
    assert work.fork == 5
    session.apply_commit(2, [4, 5])  # agrees with the chain; position 5 is still undecided
    chunk = drafter._finish(work, Step(drawn=((11, None, None),))).chunk
    assert chunk is not None and chunk.branch_of == session.epoch == 0 and list(chunk.tokens) == [9, 11]
    assert session.branches[0].fork == 5 and session.branches[0].tokens == [9, 11]
    # A round growing that branch also outlives the next agreeing commit.
    drafter, work = branch_round(session)
    assert work.growing is session.branches[0]
    session.apply_commit(4, [6])
    chunk = drafter._finish(work, Step(drawn=((12, None, None),))).chunk
    assert chunk is not None and chunk.epoch == session.branches[0].epoch and list(chunk.tokens) == [12]
    assert chunk.start == 7 and session.branches[0].tokens == [9, 11, 12]


def test_a_branch_round_whose_fork_a_commit_decided_or_whose_chain_it_replaced_is_dropped():
    for commit in ([4, 5, 6], [4, 3]):  # decides the fork; contradicts the chain before it
        session = session_with_chain([7, 8, 4, 5, 6, 1, 2, 3, 4, 5, 6], committed=2)
        session.max_ahead = 6
        session.kv_tokens = list(session.chain)
        session.doubts = {4: Doubt(0.1, 9, None)}
        drafter, work = branch_round(session)
        session.apply_commit(2, commit)
        assert drafter._finish(work, Step(drawn=((11, None, None),))).chunk is None
        assert session.branches == []


def test_a_round_growing_the_branch_a_commit_took_continues_the_new_chain():
    session = session_with_chain([7, 8, 4, 5, 6, 1, 2, 3, 4, 5, 6], committed=2)
    session.max_ahead = 6
    session.kv_tokens = list(session.chain)
    session.branches = [Branch(epoch=3, fork=3, tokens=[9, 1], doubts=[None, None])]
    session.next_epoch = 4
    drafter, work = branch_round(session)
    assert work.growing is session.branches[0]
    session.apply_commit(2, [4, 9])  # the target took the branch
    assert session.epoch == 3 and session.chain == [7, 8, 4, 9, 1]
    chunk = drafter._finish(work, Step(drawn=((13, None, None),))).chunk
    assert chunk is not None and (chunk.epoch, chunk.start, list(chunk.tokens)) == (3, 5, [13])
    assert not chunk.HasField("branch_of") and session.chain == [7, 8, 4, 9, 1, 13]
