"""The target's bookkeeping of draft chains: only tokens drafted on the committed prefix are verified."""

import random

import numpy as np

from duo.sampling.distributions import SparseDist
from duo.target.chain import DraftChain


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


def chain_with_a_branch() -> DraftChain:
    """Prompt [7, 8]; chain 0 holds [4, 5, 6] at positions 2..4; branch 1 forks at 3 assuming 9."""
    chain = DraftChain([7, 8])
    chain.receive(0, 2, [4, 5, 6], [])
    chain.receive(1, 3, [9, 1], [], branch_of=0)
    chain.receive(1, 5, [2], [])  # the branch grows
    return chain


def test_a_branch_forking_at_the_rejected_position_takes_over_with_its_drafts_pending():
    chain = chain_with_a_branch()
    chain.committed.extend([4, 9])  # 4 accepted, 5 rejected: the target committed 9 at position 3
    chain.on_commit()
    assert chain.pending()[0] == [1, 2] and chain.epoch == 1 and chain.branch_hits == 1


def test_a_branch_that_assumed_another_token_dies_with_the_chain():
    chain = chain_with_a_branch()
    chain.committed.extend([4, 3])
    chain.on_commit()
    assert chain.pending()[0] == [] and chain.branch_hits == 0
    chain.receive(1, 6, [3], [])  # more of the dead branch
    assert chain.pending()[0] == []


def test_a_branch_past_the_chains_end_continues_it_after_the_bonus_token():
    chain = DraftChain([7, 8])
    chain.receive(0, 2, [4, 5], [])
    chain.receive(1, 4, [6, 1], [], branch_of=0)
    chain.committed.extend([4, 5, 6])  # both drafts accepted, and the bonus token is the branch's
    chain.on_commit()
    assert chain.pending()[0] == [1] and chain.branch_hits == 1


def test_a_commit_that_agrees_with_the_chain_at_the_fork_makes_the_branch_stale():
    chain = chain_with_a_branch()
    chain.committed.extend([4, 5])
    chain.on_commit()
    assert chain.pending()[0] == [6] and chain.branches == {}
    chain.receive(1, 6, [3], [])  # the draft had not heard yet: its branch is ignored
    assert chain.pending()[0] == [6]


def test_a_newer_epoch_makes_every_branch_stale():
    chain = chain_with_a_branch()
    chain.committed.append(3)  # 4 rejected: neither chain nor branch can be right any more
    chain.on_commit()
    chain.receive(2, 3, [5], [])
    assert chain.pending()[0] == [5] and chain.branches == {}


def test_a_branch_arriving_just_after_the_commit_it_assumed_still_takes_over():
    chain = DraftChain([7, 8])
    chain.receive(0, 2, [4, 5, 6], [])
    chain.committed.extend([4, 9])  # the chain died at position 3 ...
    chain.on_commit()
    chain.receive(1, 3, [9, 1, 2], [], branch_of=0)  # ... while the branch assuming 9 there was on its way
    assert chain.pending()[0] == [1, 2] and chain.branch_hits == 1


def test_a_branch_arriving_after_its_fork_was_decided_for_the_chain_is_ignored():
    chain = DraftChain([7, 8])
    chain.receive(0, 2, [4, 5, 6], [])
    chain.committed.extend([4, 5])
    chain.on_commit()
    chain.receive(1, 3, [9, 1], [], branch_of=0)
    assert chain.pending()[0] == [6] and chain.branches == {}


def test_a_branch_of_another_chain_or_outside_it_is_ignored():
    chain = DraftChain([7, 8])
    chain.receive(0, 2, [4, 5], [])
    chain.receive(1, 3, [9, 1], [], branch_of=5)  # no chain of epoch 5
    chain.receive(2, 7, [9, 1], [], branch_of=0)  # forks beyond the chain's end
    assert chain.branches == {}


def test_a_pause_holds_for_the_chain_it_names_until_the_next_commit():
    committed = [7, 8]
    chain = DraftChain(committed)
    chain.receive(0, 2, [1, 2], [])
    chain.receive(0, 4, [], [], paused=True)
    assert chain.draft_paused()
    committed.append(1)
    chain.on_commit()
    assert not chain.draft_paused()  # after a commit the draft drafts again (and says so if it pauses again)
    chain.receive(0, 4, [], [], paused=True)
    assert chain.draft_paused()
    chain.receive(0, 4, [3], [])
    assert not chain.draft_paused()  # it drafted past the pause: the pause was about an older end
    chain.receive(0, 9, [], [], paused=True)  # not at the chain's end
    assert not chain.draft_paused()
    chain.receive(5, 2, [], [], paused=True)  # a new chain paused at a position already committed: stale
    assert not chain.draft_paused()


def test_has_pending_says_whether_pending_holds_tokens_through_a_chains_life():
    committed = [7, 8]
    chain = DraftChain(committed)
    states = [chain.has_pending() == bool(chain.pending()[0])]
    chain.receive(0, 2, [1, 2], [])
    states.append(chain.has_pending() == bool(chain.pending()[0]) is True)
    committed.extend([1, 2])
    chain.on_commit()
    states.append(chain.has_pending() == bool(chain.pending()[0]) is False)
    committed.append(9)
    chain.on_commit()
    chain.receive(1, 5, [3], [])
    states.append(chain.has_pending() == bool(chain.pending()[0]) is True)
    committed.append(4)  # contradicts the chain: dead until the next epoch
    chain.on_commit()
    states.append(chain.has_pending() == bool(chain.pending()[0]) is False)
    assert all(states), states


def _tagged(epoch: int, position: int):
    """A distribution that names the line and position it was sent for (ids: the epoch; probs: one)."""
    return SparseDist(ids=np.array([epoch * 10_000 + position]), probs=np.array([1.0]))


def test_every_pending_token_comes_with_the_distribution_the_draft_sent_for_its_position():
    """A simulated draft streams chunks, branches and new epochs in random order while the target
    commits: after every event, each pending token and its distribution are exactly what the draft sent
    for the chain's epoch at that position (None only at a branch's assumed first token), however the
    chain was cut by commits, extended, replaced by a branch or restarted."""
    for seed in range(60):
        rng = random.Random(seed)
        truth = [rng.randrange(50) for _ in range(200)]  # what the target commits, position by position
        committed = truth[:3]
        chain = DraftChain(committed)
        sent: dict[tuple[int, int], tuple[int, object]] = {}
        lines: dict[int, int] = {}  # the draft's lines: epoch -> the end it drafted to
        main_epoch, next_epoch = None, 0

        def send(epoch: int, start: int, tokens: list[int], branch_of: int | None = None) -> None:
            dists = [_tagged(epoch, start + i) for i in range(len(tokens))]
            for i, token in enumerate(tokens):
                sent[(epoch, start + i)] = (token, None if branch_of is not None and i == 0 else dists[i])
            lines[epoch] = start + len(tokens)
            chain.receive(epoch, start, tokens, dists, branch_of=branch_of)

        def guess(position: int) -> int:
            return truth[position] if rng.random() < 0.75 else rng.randrange(50)

        for _ in range(120):
            action = rng.random()
            if main_epoch is None or action < 0.1:  # the draft restarts its chain at the committed end
                main_epoch, next_epoch = next_epoch, next_epoch + 1
                start = len(committed)
                send(main_epoch, start, [guess(start + i) for i in range(rng.randint(1, 3))])
            elif action < 0.5:  # the chain grows
                end = lines[main_epoch]
                send(main_epoch, end, [guess(end + i) for i in range(rng.randint(1, 3))])
            elif action < 0.7:  # a branch where the chain was unsure, or at its end
                fork = rng.randint(len(committed), max(len(committed), lines[main_epoch]))
                epoch, next_epoch = next_epoch, next_epoch + 1
                send(epoch, fork, [truth[fork] if rng.random() < 0.6 else rng.randrange(50)]
                     + [guess(fork + 1 + i) for i in range(rng.randint(0, 2))], branch_of=main_epoch)
            else:  # the target verifies what is pending and commits what it accepts, then one of its own
                pending, _ = chain.pending()
                accepted = 0
                while accepted < len(pending) and pending[accepted] == truth[len(committed) + accepted]:
                    accepted += 1
                committed.extend(truth[len(committed):len(committed) + accepted + 1])
                chain.on_commit()
                if chain.main is not None:
                    main_epoch = chain.main.epoch  # a branch took over: the draft follows it
            tokens, dists = chain.pending()
            for i, (token, dist) in enumerate(zip(tokens, dists)):
                expected_token, expected_dist = sent[(chain.main.epoch, len(committed) + i)]
                assert token == expected_token, (seed, i)
                assert dist is expected_dist, (seed, i, chain.main.epoch, len(committed) + i)


def test_a_branch_the_target_did_not_keep_never_replaces_the_chain():
    """A branch refused on arrival (its fork already decided by a longer commit) still makes its epoch known: its
    later chunks, which carry no branch_of, are its own and dropped with it, never taken for a restarted chain
    (which threw the live chain away and verified tokens drafted after the branch's wrong assumption)."""
    chain = DraftChain([7, 8])
    chain.receive(0, 2, [4, 5, 6, 10], [])
    chain.committed.extend([4, 5, 6])
    chain.on_commit()
    chain.receive(1, 3, [9, 1], [], branch_of=0)  # its fork (position 3) is decided already: not kept
    chain.receive(1, 5, [2], [])                  # the branch grows (no branch_of)
    chain.receive(0, 6, [11], [])                 # and so does the chain
    assert chain.pending()[0] == [10, 11] and chain.epoch == 0
