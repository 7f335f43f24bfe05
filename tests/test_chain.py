"""The target's bookkeeping of draft chains: only tokens drafted on the committed prefix are verified."""

from duo.chain import DraftChain


def test_tokens_beyond_the_committed_prefix_are_pending():
    chain = DraftChain(committed=[7, 8])
    chain.receive(epoch=0, start=2, tokens=[1, 2], dists=[])
    chain.receive(epoch=0, start=4, tokens=[3], dists=[])
    assert chain.pending()[0] == [1, 2, 3]


def test_accepted_tokens_leave_the_pending_list_and_later_ones_stay():
    committed = [7, 8]
    chain = DraftChain(committed)
    chain.receive(0, 2, [1, 2, 3], [])
    committed.extend([1, 2])
    chain.on_commit()
    assert chain.pending()[0] == [3]


def test_a_commit_that_contradicts_the_chain_kills_it():
    committed = [7, 8]
    chain = DraftChain(committed)
    chain.receive(0, 2, [1, 2, 3], [])
    committed.extend([1, 9])  # the target rejected 2 and committed 9 instead
    chain.on_commit()
    assert chain.pending()[0] == []
    chain.receive(0, 5, [4], [])  # still the dead epoch: drafted after 2, not after 9
    assert chain.pending()[0] == []


def test_a_new_epoch_restarts_the_chain_at_a_committed_position():
    committed = [7, 8, 1, 9]
    chain = DraftChain(committed)
    chain.receive(0, 2, [1, 2], [])
    chain.on_commit()
    chain.receive(1, 4, [5, 6], [])
    assert chain.pending()[0] == [5, 6]


def test_stale_chunks_of_an_older_epoch_are_discarded():
    committed = [7, 8]
    chain = DraftChain(committed)
    chain.receive(1, 2, [5], [])
    chain.receive(0, 3, [4], [])
    assert chain.pending()[0] == [5]


def test_chain_tokens_that_arrive_after_their_position_was_committed_are_checked():
    committed = [7, 8]
    chain = DraftChain(committed)
    committed.append(3)  # the target decoded alone before the draft's token arrived
    chain.receive(0, 2, [3, 4], [])  # the draft guessed 3 too: 4 was drafted on the right prefix
    assert chain.pending()[0] == [4]
    other = DraftChain([7, 8, 3])
    other.receive(0, 2, [6, 4], [])  # the draft guessed 6: its 4 is useless
    assert other.pending()[0] == []


def test_a_gap_within_an_epoch_kills_the_chain():
    chain = DraftChain([7, 8])
    chain.receive(0, 2, [1], [])
    chain.receive(0, 4, [3], [])
    assert chain.pending()[0] == []


def test_a_chain_anchored_beyond_the_committed_tokens_is_refused():
    chain = DraftChain([7, 8])
    chain.receive(0, 5, [1], [])
    assert chain.pending()[0] == []


def test_reset_forgets_the_chain_and_counts_received_tokens():
    chain = DraftChain([7, 8])
    chain.receive(3, 2, [1, 2], [])
    chain.reset()
    assert chain.pending()[0] == []
    chain.receive(0, 2, [5], [])  # a reconnected draft starts again at epoch 0
    assert chain.pending()[0] == [5]
    assert chain.received == 3
