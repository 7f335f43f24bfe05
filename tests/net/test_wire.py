"""Conversions between protobuf messages and duo's types."""

import numpy as np
import pytest

from duo.cli import draft as draft_process
from duo.net import wire
from duo.net._proto import duo_pb2 as pb
from duo.sampling.distributions import SparseDist
from duo.sampling.params import SamplingParams

N_VOCAB = 100


def test_sampling_params_and_seed_survive_the_wire():
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05)
    back, seed = wire.sampling_from_pb(wire.sampling_to_pb(params, 42), None)
    assert seed == 42 and back.top_k == 40 and back.temperature == pytest.approx(0.7)
    assert wire.sampling_from_pb(wire.sampling_to_pb(params, None), None)[1] is None


def test_an_unset_top_p_means_no_nucleus_cut():
    assert wire.sampling_from_pb(pb.SamplingParams(temperature=1.0), None)[0].top_p == 1.0


def test_a_draft_distribution_is_renormalised_after_float32_rounding():
    q = wire.dist_from_pb(wire.dist_to_pb(SparseDist(np.array([5, 9]), np.array([0.3, 0.7]))), N_VOCAB)
    assert q.ids.tolist() == [5, 9] and q.probs.sum() == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("ids, probs", [([1, 2], [0.5]), ([], []), ([1], [float("nan")]), ([1], [float("inf")]),
                                        ([1], [-1.0]), ([1], [0.0]), ([1, 1], [0.5, 0.5]), ([-1], [1.0]),
                                        ([N_VOCAB], [1.0])])
def test_a_malformed_draft_distribution_is_refused(ids, probs):
    with pytest.raises(ValueError, match="distribution"):
        wire.dist_from_pb(pb.SparseDist(ids=ids, probs=probs), N_VOCAB)


# --- chunks from an untrusted draft -------------------------------------------------------------------------
# A session with 10 committed tokens, chain epoch 2, that allows chain tokens up to position 20.
BOUNDS = wire.ChunkBounds(n_vocab=N_VOCAB, n_committed=10, epoch=2, max_end=20, live=frozenset({2}))


def dist(*ids: int) -> pb.SparseDist:
    return pb.SparseDist(ids=list(ids), probs=[1.0] * len(ids))


def test_a_valid_chunk_passes_whole_with_its_distributions():
    chunk, rejection = wire.chunk_from_pb(pb.DraftChunk(epoch=3, start=10, tokens=[5, 7], dists=[dist(5, 6), dist(7)]),
                                          BOUNDS)
    assert rejection is None
    assert (chunk.epoch, chunk.start, chunk.tokens) == (3, 10, [5, 7])
    assert [d.ids.tolist() for d in chunk.dists] == [[5, 6], [7]] and chunk.dists[0].probs.tolist() == [0.5, 0.5]


def test_a_greedy_chunk_continuing_its_chain_may_start_beyond_the_committed_tokens():
    chunk, rejection = wire.chunk_from_pb(pb.DraftChunk(epoch=2, start=15, tokens=[5]), BOUNDS)
    assert rejection is None and chunk.tokens == [5] and chunk.dists == []


def test_valid_tokens_before_an_invalid_one_are_kept():
    chunk, rejection = wire.chunk_from_pb(pb.DraftChunk(epoch=2, start=10, tokens=[5, 7, 300, 8]), BOUNDS)
    assert chunk.tokens == [5, 7]
    assert (rejection.reason, rejection.entries) == ("token", 2) and "300" in rejection.detail


def test_a_sampled_chunk_keeps_the_prefix_before_a_bad_distribution_with_its_distributions():
    nan = pb.SparseDist(ids=[8], probs=[float("nan")])
    chunk, rejection = wire.chunk_from_pb(
        pb.DraftChunk(epoch=2, start=10, tokens=[5, 7, 8, 9], dists=[dist(5), dist(7), nan, dist(9)]), BOUNDS)
    assert chunk.tokens == [5, 7] and len(chunk.dists) == 2
    assert (rejection.reason, rejection.entries) == ("distribution", 2)


@pytest.mark.parametrize("message, kept, reason, dropped", [
    (pb.DraftChunk(epoch=2, start=10, tokens=[5, -3]), [5], "token", 1),
    (pb.DraftChunk(epoch=2, start=10, tokens=[N_VOCAB]), [], "token", 1),
    (pb.DraftChunk(epoch=2, start=10, tokens=[5, 6], dists=[dist(5), dist(5)]), [5], "distribution", 1),
    (pb.DraftChunk(epoch=2, start=10, tokens=[5], dists=[pb.SparseDist(ids=[5, 6], probs=[0.0, 1.0])]), [],
     "distribution", 1),
    (pb.DraftChunk(epoch=2, start=10, tokens=[5], dists=[dist(5, 5)]), [], "distribution", 1),
    (pb.DraftChunk(epoch=2, start=10, tokens=[5], dists=[pb.SparseDist(ids=[5], probs=[-1.0])]), [],
     "distribution", 1),
    (pb.DraftChunk(epoch=2, start=10, tokens=[5, 6, 7], dists=[dist(5)]), [5], "length", 2),
    (pb.DraftChunk(epoch=2, start=10, tokens=[5], dists=[dist(5), dist(6)]), [5], "length", 1),
    (pb.DraftChunk(epoch=2, start=18, tokens=[1] * 200_000), [1, 1], "lead", 199_998),
    (pb.DraftChunk(epoch=2, start=2 ** 32 - 1, tokens=[1]), [], "lead", 1),
    (pb.DraftChunk(epoch=wire.max_epoch(10) + 1, start=10, tokens=[5, 6]), [], "epoch", 2),
    (pb.DraftChunk(epoch=2 ** 32 - 1, start=10, tokens=[5]), [], "epoch", 1),
    (pb.DraftChunk(epoch=3, start=11, tokens=[5]), [], "position", 1),
])
def test_a_chunk_is_cut_at_its_first_entry_that_breaks_a_bound(message, kept, reason, dropped):
    chunk, rejection = wire.chunk_from_pb(message, BOUNDS)
    assert chunk.tokens == kept
    assert (rejection.reason, rejection.entries) == (reason, dropped)
    assert rejection.reason in wire.REJECTION_REASONS


def test_a_stale_epoch_is_no_fault_of_the_draft_and_is_dropped_unread(monkeypatch):
    parsed = count_parsed_distributions(monkeypatch)
    stale = pb.DraftChunk(epoch=1, start=0, tokens=[5] * 20, dists=[dist(*range(5, 100))] * 20)
    chunk, rejection = wire.chunk_from_pb(stale, BOUNDS)
    assert rejection is None and chunk.tokens == [] and parsed == []  # the chain would discard it anyway


def test_an_entry_at_a_committed_position_has_its_token_checked_but_its_distribution_left_unread(monkeypatch):
    parsed = count_parsed_distributions(monkeypatch)
    chunk, rejection = wire.chunk_from_pb(pb.DraftChunk(epoch=2, start=8, tokens=[5, 6, 7], dists=[dist(5), dist(6),
                                                                                                   dist(7)]), BOUNDS)
    assert rejection is None and chunk.tokens == [5, 6, 7]
    assert chunk.dists[:2] == [None, None] and chunk.dists[2].ids.tolist() == [7] and len(parsed) == 1
    _, rejection = wire.chunk_from_pb(pb.DraftChunk(epoch=2, start=8, tokens=[5, 300]), BOUNDS)
    assert rejection.reason == "token"  # a committed position's token is still checked


def count_parsed_distributions(monkeypatch) -> list[pb.SparseDist]:
    parsed: list[pb.SparseDist] = []
    real = wire.dist_from_pb
    monkeypatch.setattr(wire, "dist_from_pb", lambda message, n_vocab: parsed.append(message) or real(message, n_vocab))
    return parsed


def test_a_branch_may_fork_ahead_of_the_committed_tokens_and_says_where_it_comes_from():
    chunk, rejection = wire.chunk_from_pb(pb.DraftChunk(epoch=3, start=12, tokens=[5, 7], branch_of=2), BOUNDS)
    assert rejection is None and (chunk.start, chunk.tokens, chunk.branch_of) == (12, [5, 7], 2)
    plain, _ = wire.chunk_from_pb(pb.DraftChunk(epoch=2, start=10, tokens=[5]), BOUNDS)
    assert plain.branch_of is None


def test_a_pause_passes_with_its_whole_chunk_but_not_when_the_link_cut_the_chunk_short():
    chunk, rejection = wire.chunk_from_pb(pb.DraftChunk(epoch=2, start=12, paused=True), BOUNDS)
    assert chunk.paused and chunk.tokens == [] and rejection is None
    chunk, rejection = wire.chunk_from_pb(pb.DraftChunk(epoch=2, start=12, tokens=[5, 300], paused=True), BOUNDS)
    assert chunk.tokens == [5] and rejection.reason == "token" and not chunk.paused


def chunk_event(session: int, epoch: int, start: int, tokens: list[int], **fields) -> pb.DraftEvent:
    return pb.DraftEvent(chunk=pb.DraftChunk(session_id=session, epoch=epoch, start=start, tokens=tokens, **fields))


def test_queued_chunks_of_one_line_travel_as_one_message_in_the_same_order():
    error = pb.DraftEvent(error=pb.SessionError(session_id=3, message="gone"))
    events = [chunk_event(1, 0, 5, [10]), chunk_event(1, 0, 6, [11]), chunk_event(2, 0, 9, [20]),
              chunk_event(1, 0, 7, [12], paused=True), chunk_event(1, 0, 8, [13]),  # a pause ends the line
              chunk_event(1, 2, 6, [30, 31], branch_of=0), chunk_event(1, 2, 8, [32]),  # a branch: its own line
              error, chunk_event(1, 0, 8, [14]), None]
    merged = wire.coalesce(events)
    lines = [None if e is None else (e.WhichOneof("event"),) + ((e.chunk.session_id, e.chunk.epoch, e.chunk.start,
             list(e.chunk.tokens), e.chunk.paused) if e.HasField("chunk") else ()) for e in merged]
    assert lines == [("chunk", 1, 0, 5, [10, 11], False), ("chunk", 2, 0, 9, [20], False),
                     ("chunk", 1, 0, 7, [12], True), ("chunk", 1, 0, 8, [13], False),
                     ("chunk", 1, 2, 6, [30, 31, 32], False), ("error",), ("chunk", 1, 0, 8, [14], False), None]
    assert merged[4].chunk.branch_of == 0


def test_a_merged_chunk_keeps_each_tokens_distribution():
    dist = lambda token: pb.SparseDist(ids=[token, 1], probs=[0.75, 0.25])
    events = [chunk_event(1, 0, 5, [10], dists=[dist(10)]), chunk_event(1, 0, 6, [11], dists=[dist(11)])]
    (merged,) = wire.coalesce(events)
    assert list(merged.chunk.tokens) == [10, 11] and [list(d.ids) for d in merged.chunk.dists] == [[10, 1], [11, 1]]


def test_a_distribution_naming_more_tokens_than_any_honest_draft_sends_is_refused_before_any_vocabulary_work():
    n_vocab = 151_936
    whole = pb.SparseDist(ids=list(range(n_vocab)), probs=[1.0] * n_vocab)
    with pytest.raises(ValueError, match=f"names {n_vocab} tokens, more than the {wire.MAX_DIST_IDS} allowed"):
        wire.dist_from_pb(whole, n_vocab)
    capped = pb.SparseDist(ids=list(range(wire.MAX_DIST_IDS)), probs=[1.0] * wire.MAX_DIST_IDS)
    assert wire.dist_from_pb(capped, n_vocab).ids.size == wire.MAX_DIST_IDS
    # In a chunk, the entry is cut like any bad distribution: the tokens before it stay.
    bounds = wire.ChunkBounds(n_vocab=n_vocab, n_committed=10, epoch=2, max_end=20, live=frozenset({2}))
    chunk, rejection = wire.chunk_from_pb(pb.DraftChunk(epoch=2, start=10, tokens=[5, 6], dists=[dist(5), whole]),
                                          bounds)
    assert chunk.tokens == [5] and rejection.reason == "distribution"


def test_duo_draft_refuses_a_top_k_cap_beyond_what_targets_accept(capsys):
    assert draft_process.main(["--model", "absent.gguf", "--listen", "127.0.0.1:0",
                               "--top-k-cap", str(wire.MAX_DIST_IDS + 1)]) == 1
    assert "--top-k-cap must be between 1 and" in capsys.readouterr().err
