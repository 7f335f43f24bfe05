"""One batched decode drafts the next token for every session that wants one: the same drafts as alone,
one model call per round, a failing session fails alone, and a closed session's sequences serve the next."""

from __future__ import annotations

import asyncio

import pytest

from duo.net._proto import duo_pb2 as pb
from duo.draft.drafter import Drafter
from duo.draft.metrics import DraftMetrics
from duo.draft.session import DraftSession
from duo.llama.model import ModelError
from duo.llama.context import Context, Part
from helpers.drafting import draft_until_idle
from helpers.draft_servicer import CountingModel, Stream, holds_nothing, servicer_for
from helpers.drafting import drafter_for

TEXTS = ["def fibonacci(n):", "Once upon a time, in a land far away", "The quick brown fox",
         "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", "import numpy as np\n"]
SETTINGS = {"n_ctx": 256, "top_k_cap": 10, "max_branches": 2, "branch_len": 2}
def messages(model) -> list[pb.OpenSession]:
    """Sessions of every kind: greedy, residual and coupled sampling, a p_min that pauses the chain."""
    prompts = [model.tokenize(text) for text in TEXTS]
    sampled = {"temperature": 1.0, "top_k": 20}
    return [
        pb.OpenSession(session_id=1, committed=prompts[0], max_ahead=8),
        pb.OpenSession(session_id=2, committed=prompts[1], max_ahead=8, sampling=pb.SamplingParams(seed=3, **sampled)),
        pb.OpenSession(session_id=3, committed=prompts[2], max_ahead=6, verification=pb.COUPLED,
                       sampling=pb.SamplingParams(seed=4, **sampled)),
        pb.OpenSession(session_id=4, committed=prompts[3], max_ahead=8, p_min=0.3,
                       sampling=pb.SamplingParams(seed=5, temperature=0.8)),
        pb.OpenSession(session_id=5, committed=prompts[4], max_ahead=10),
    ]


def commit_one_and_a_comma(drafter: Drafter, session: DraftSession) -> None:
    """What a target might commit: the first draft, then a token of its own (a comma)."""
    drafter.commit(session, session.committed, [session.chain[session.committed], 11])


async def draft_with_a_commit(drafter: Drafter, sessions: list[DraftSession]) -> tuple[dict, int]:
    """Rounds until idle, a commit for every session, rounds until idle again: the chunks and the rounds."""
    before, rounds = await draft_until_idle(drafter, sessions)
    for session in sessions:
        commit_one_and_a_comma(drafter, session)
    after, more = await draft_until_idle(drafter, sessions)
    return {sid: before[sid] + after[sid] for sid in before}, rounds + more


def assert_drafted_alike(drafted: dict[int, list[pb.DraftChunk]], expected: dict[int, list[pb.DraftChunk]]) -> None:
    """The same tokens at the same positions, epochs, branches and pauses, and each sampled token's q
    within 0.05: a batch rounds a session's logits a little differently from a decode alone (llama.cpp's
    kernels depend on the batch's size, as a verify batch and a single step differ too). So a sampled
    draw whose random number falls between the two q's cumulative sums may differ (a near-tie of
    sampling); from there on, that session's drafts follow another path and are not compared."""
    def shape(chunk: pb.DraftChunk) -> tuple:
        return (chunk.epoch, chunk.start, list(chunk.tokens), chunk.branch_of if chunk.HasField("branch_of") else None,
                chunk.paused, len(chunk.dists))

    def qs(chunk: pb.DraftChunk) -> list[float]:
        return [dict(zip(dist.ids, dist.probs)).get(token, 0.0) for dist, token in zip(chunk.dists, chunk.tokens)]

    assert drafted.keys() == expected.keys()
    for sid, chunks in drafted.items():
        theirs = expected[sid]
        same = next((i for i, (a, b) in enumerate(zip(chunks, theirs)) if shape(a) != shape(b)),
                    min(len(chunks), len(theirs)))
        for ours, alone in zip(chunks[:same], theirs[:same]):
            assert qs(ours) == pytest.approx(qs(alone), abs=0.05), sid
        if same < max(len(chunks), len(theirs)):
            assert same < min(len(chunks), len(theirs)), f"session {sid} drafted more or less than alone"
            ours, alone = chunks[same], theirs[same]
            assert (ours.epoch, ours.start) == (alone.epoch, alone.start) and ours.dists and alone.dists, sid
            # Each side's token is one the other side's q could draw about as likely: a boundary, not a bug.
            for dist_ours, dist_alone in zip(ours.dists, alone.dists):
                q_ours, q_alone = dict(zip(dist_ours.ids, dist_ours.probs)), dict(zip(dist_alone.ids, dist_alone.probs))
                assert q_ours.keys() == q_alone.keys() and all(
                    abs(q_ours[i] - q_alone[i]) <= 0.05 for i in q_ours), sid


async def drafted_alone(model, message: pb.OpenSession) -> list[pb.DraftChunk]:
    drafter = drafter_for(model, **SETTINGS)
    session = await drafter.open(message)
    chunks, _ = await draft_with_a_commit(drafter, [session])
    await drafter.close(session)
    await drafter.stop()
    return chunks[message.session_id]


def test_a_batched_round_drafts_for_each_session_what_it_drafts_alone(draft_model):
    async def run() -> tuple[dict, int, dict]:
        drafter = drafter_for(draft_model, **SETTINGS)
        sessions = [await drafter.open(message) for message in messages(draft_model)]
        together, rounds = await draft_with_a_commit(drafter, sessions)
        await drafter.close(*sessions)
        await drafter.stop()
        alone = {message.session_id: await drafted_alone(draft_model, message) for message in messages(draft_model)}
        return together, rounds, alone

    together, rounds, alone = asyncio.run(run())
    assert_drafted_alike(together, alone)
    chunks = [chunk for session_chunks in together.values() for chunk in session_chunks]
    assert any(chunk.HasField("branch_of") for chunk in together[1]) and any(chunk.dists for chunk in together[2])
    assert any(chunk.epoch > 0 and not chunk.HasField("branch_of") for chunk in chunks)  # after the commit
    assert any(chunk.paused for chunk in together[4]), "p_min never paused: the test would miss pauses"
    assert rounds < len(chunks) / 2  # several sessions per round


def test_n_sessions_cost_one_model_call_per_round(draft_model):
    model = CountingModel(draft_model)

    async def run() -> int:
        drafter = drafter_for(model, **SETTINGS)
        sessions = [await drafter.open(message) for message in messages(draft_model)]
        _, rounds = await draft_until_idle(drafter, sessions)
        await drafter.close(*sessions)
        await drafter.stop()
        return rounds

    rounds = asyncio.run(run())
    assert len(model.calls) == rounds and model.calls[0] == len(TEXTS)


def test_a_commit_during_a_round_makes_that_sessions_token_stale_and_no_other(draft_model):
    model = CountingModel(draft_model, delay=0.2)

    async def run() -> tuple[list, list]:
        drafter = drafter_for(model, **SETTINGS)
        first, second = [await drafter.open(message) for message in messages(draft_model)[:2]]
        model.decoding.clear()
        round_ = asyncio.create_task(drafter.draft_round([first, second]))
        await asyncio.to_thread(model.decoding.wait, 5)  # the round is on the model thread
        drafter.commit(first, first.committed, [11])  # the target decided before the draft had a token
        during = [(drafted.session.session_id, drafted.chunk) for drafted in await round_]
        after = [(drafted.session.session_id, drafted.chunk.epoch, drafted.chunk.start)
                 for drafted in await drafter.draft_round([first, second])]
        await drafter.close(first, second)
        await drafter.stop()
        return during, after

    during, after = asyncio.run(run())
    assert during[0] == (1, None) and during[1][0] == 2 and during[1][1].tokens
    assert after[0] == (1, 1, len(draft_model.tokenize(TEXTS[0])) + 1)  # a new epoch after the commit


def test_a_session_that_finds_no_room_in_the_shared_cache_fails_alone(draft_model):
    """Sessions 1 and 3 hold about 35 of the 80 cells; session 2's prompt needs 60: it gets a
    SessionError, and the others keep drafting."""
    async def run() -> dict[int, str]:
        servicer, _ = servicer_for(draft_model, n_ctx=64, cells=80)
        stream = Stream(servicer)
        stream.open(1)
        stream.open(3, committed=draft_model.tokenize(TEXTS[1] * 3)[:25])
        await stream.until(lambda: len(stream.chunks(1)) == len(stream.chunks(3)) == 4)
        stream.open(2, committed=[11] * 60)
        await stream.until(lambda: 2 in stream.errors())
        stream.send(commit=pb.Commit(session_id=1, start=3, tokens=[stream.chunks(1)[0].tokens[0] + 1]))
        stream.send(commit=pb.Commit(session_id=3, start=25, tokens=[stream.chunks(3)[0].tokens[0] + 1]))
        await stream.until(lambda: len(stream.chunks(1)) == len(stream.chunks(3)) == 8)
        await stream.end()
        assert await holds_nothing(servicer.drafter)
        await servicer.drafter.stop()
        return stream.errors()

    errors = asyncio.run(run())
    assert list(errors) == [2] and "KV cache is full" in errors[2] and "--kv-cells" in errors[2]


class RefusingContext:
    """The shared context, except that a call decoding sequence `bad` fails, as llama_decode does when
    the cache has no room for a batch."""

    def __init__(self, context: Context, bad: int) -> None:
        self._context = context
        self.bad = bad
        self.calls: list[int] = []  # parts per call

    def __getattr__(self, name: str):
        return getattr(self._context, name)

    def decode_parts(self, parts: list[Part]):
        self.calls.append(len(parts))
        if any(part.seq == self.bad for part in parts):
            raise ModelError("llama_decode failed: llama_decode returned 1")
        return self._context.decode_parts(parts)


def test_when_llama_refuses_a_batched_call_each_part_is_retried_alone_and_only_the_failing_one_fails(draft_model):
    async def run() -> tuple[dict[int, object], list[int]]:
        drafter = drafter_for(draft_model, **SETTINGS)
        sessions = [await drafter.open(message) for message in messages(draft_model)[:3]]
        refusing = RefusingContext(drafter.cache.context, bad=sessions[1].slot.chain)
        drafter.cache.context = refusing
        drafted = {result.session.session_id: result.error or result.chunk
                   for result in await drafter.draft_round(sessions)}
        drafter.cache.context = refusing._context
        await drafter.close(*sessions)
        await drafter.stop()
        return drafted, refusing.calls

    drafted, calls = asyncio.run(run())
    assert calls == [3, 1, 1, 1]
    assert isinstance(drafted[2], ModelError)
    assert drafted[1].tokens and drafted[3].tokens


def test_a_closed_sessions_sequences_serve_the_next_session(draft_model):
    """Two slots, five sessions opened and closed in turns: each drafts what it drafts alone (nothing of
    an earlier session's cache is left), a third session at once finds no slot, and all is freed."""
    async def run() -> tuple[dict, bool]:
        drafter = drafter_for(draft_model, max_sessions=2, **SETTINGS)
        chunks: dict[int, list[pb.DraftChunk]] = {}
        held: list[DraftSession] = []
        for message in messages(draft_model):
            if len(held) == 2:
                with pytest.raises(ModelError, match="every slot"):
                    await drafter.open(message)
                await drafter.close(held.pop(0))
            held.append(await drafter.open(message))
            drafted, _ = await draft_with_a_commit(drafter, held[-1:])
            chunks.update(drafted)
        await drafter.close(*held)
        freed = await holds_nothing(drafter)
        await drafter.stop()
        alone = {message.session_id: await drafted_alone(draft_model, message) for message in messages(draft_model)}
        assert_drafted_alike(chunks, alone)
        return chunks, freed

    chunks, freed = asyncio.run(run())
    assert len(chunks) == len(TEXTS) and freed


def test_the_metrics_count_sessions_and_tokens_per_batched_call(draft_model):
    metrics = DraftMetrics()

    async def run() -> int:
        drafter = drafter_for(draft_model, observer=metrics, **SETTINGS)
        sessions = [await drafter.open(message) for message in messages(draft_model)[:3]]
        await drafter.draft_round(sessions)
        second = await drafter.draft_round(sessions)  # each chain's lead, and a branch riding beside it
        await drafter.close(*sessions)
        await drafter.stop()
        return len(second)

    works = asyncio.run(run())
    sample = metrics.registry.get_sample_value
    assert works > 3, "no branch rode in the second round: the test would miss riders"
    assert sample("duo_draft:round_seconds_count") == 2
    assert sample("duo_draft:sessions_per_round_sum") == 3 + 3  # a chain and its branch: one session
    prompts = sum(len(draft_model.tokenize(text)) for text in TEXTS[:3])
    assert sample("duo_draft:tokens_per_round_sum") == prompts + works
    assert sample("duo_draft:draft_tokens_total") == 3 + works


def test_a_new_session_starts_from_a_prefix_another_session_holds_and_drafts_as_it_would_alone(draft_model):
    system = draft_model.tokenize("<|im_start|>system\nYou write careful Python.<|im_end|>\n<|im_start|>user\n")
    first, second = (pb.OpenSession(session_id=i, committed=system + draft_model.tokenize(text, add_special=False),
                                    max_ahead=8) for i, text in ((1, "sort a list"), (2, "reverse a string")))
    decoded: list[Part] = []

    async def run() -> list[pb.DraftChunk]:
        drafter = drafter_for(draft_model, **SETTINGS)
        await drafter.start()
        context = drafter.cache.context
        decode_parts = context.decode_parts
        context.decode_parts = lambda parts: decoded.extend(parts) or decode_parts(parts)
        one = await drafter.open(first)
        await draft_until_idle(drafter, [one])
        decoded.clear()
        two = await drafter.open(second)
        chunks, _ = await draft_with_a_commit(drafter, [two])
        await drafter.close(one, two)
        await drafter.stop()
        return chunks[2]

    chunks = asyncio.run(run())
    # Its first call decodes only what follows the shared system turn.
    assert (decoded[0].pos, list(decoded[0].tokens)) == (len(system), list(second.committed[len(system):]))
    assert_drafted_alike({2: chunks}, {2: asyncio.run(drafted_alone(draft_model, second))})
