"""The draft's confidence in each token crosses the link checked: a probability per token, or the chunk is cut there,
as a bad distribution cuts it; a draft that sends none is an older draft, not a faulty one."""

import math

import pytest

from duo.net import wire
from duo.net._proto import duo_pb2 as pb

# A session with 10 committed tokens, chain epoch 2, that allows chain tokens up to position 20.
BOUNDS = wire.ChunkBounds(n_vocab=100, n_committed=10, epoch=2, max_end=20, live=frozenset({2}))


def test_each_tokens_confidence_passes_with_it():
    chunk, rejection = wire.chunk_from_pb(pb.DraftChunk(epoch=2, start=10, tokens=[5, 7], confidence=[0.25, 1.0]),
                                          BOUNDS)
    assert rejection is None and chunk.tokens == [5, 7] and chunk.confidences == [0.25, 1.0]


def test_a_chunk_without_confidences_passes_as_before():
    chunk, rejection = wire.chunk_from_pb(pb.DraftChunk(epoch=2, start=10, tokens=[5, 7]), BOUNDS)
    assert rejection is None and chunk.tokens == [5, 7] and chunk.confidences == []


@pytest.mark.parametrize("confidence, kept, reason, dropped", [
    ([0.5, math.nan, 0.5], [5], "confidence", 2),
    ([0.5, 0.5, 1.5], [5, 6], "confidence", 1),
    ([-0.25, 0.5, 0.5], [], "confidence", 3),
    ([math.inf, 0.5, 0.5], [], "confidence", 3),
    ([0.5, 0.5], [5, 6], "length", 1),
    ([0.5, 0.5, 0.5, 0.5], [5, 6, 7], "length", 1),
], ids=["NaN", "above 1", "below 0", "infinite", "one short", "one too many"])
def test_a_bad_confidence_cuts_the_chunk_before_it_as_the_drafts_fault(confidence, kept, reason, dropped):
    chunk, rejection = wire.chunk_from_pb(pb.DraftChunk(epoch=2, start=10, tokens=[5, 6, 7], confidence=confidence),
                                          BOUNDS)
    assert chunk.tokens == kept and len(chunk.confidences) == len(kept)
    assert (rejection.reason, rejection.entries) == (reason, dropped)
    assert rejection.reason in wire.REJECTION_REASONS


def test_merged_chunks_keep_each_tokens_confidence_and_a_line_with_them_never_merges_with_one_without():
    def chunk(start: int, tokens: list[int], confidence: list[float]) -> pb.DraftEvent:
        return pb.DraftEvent(chunk=pb.DraftChunk(session_id=1, epoch=0, start=start, tokens=tokens,
                                                 confidence=confidence))

    merged = wire.coalesce([chunk(5, [10], [0.5]), chunk(6, [11, 12], [0.25, 0.75]), chunk(8, [13], [])])
    assert [(list(e.chunk.tokens), list(e.chunk.confidence)) for e in merged] == [
        ([10, 11, 12], [0.5, 0.25, 0.75]), ([13], [])]
