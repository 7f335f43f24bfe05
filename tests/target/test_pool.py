"""The pool of drafts by hand (duo.target.pool): sessions placed by measured worth, moved when a draft joins, is lost,
is judged off or is full, with a simulated clock and drafts that record what the target sends them."""

from __future__ import annotations

import asyncio

import pytest

from duo.llama.worker import ModelWorker
from duo.net._proto import duo_pb2 as pb
from duo.net.wire import ChainChunk
from duo.sampling.params import SamplingParams
from duo.target.generation import Generation
from duo.target.pool import placement
from duo.target.pool.joined import allowed, parse_allow, peer_host
from duo.target.pool.placement import DraftView, better_home, choose, worth
from duo.target.pool.pool import FAULTY_FOR_S, RETRIAL_S, ROOM_RETRY_S, DraftPool
from duo.target.request import Request, SpecSettings
from duo.target.switch import Switch
from duo.target.target import Target
from helpers.clock import Clock
from helpers.fake_drafts import RecordingDraft

DEMAND = 20.0  # drafts a second one session can use


def pool_of(*drafts: RecordingDraft) -> tuple[DraftPool, Clock]:
    clock = Clock(100.0)
    pool = DraftPool(Switch, lambda: DEMAND, clock=clock)
    for draft in drafts:
        pool.add(draft)
    return pool, clock


def session(session_id: int, prompt: list[int] | None = None) -> Generation:
    generation = Generation(session_id, Request(prompt or [1, 2, 3], SamplingParams()), None, SpecSettings())
    generation.switch = Switch()
    return generation


def opened(draft: RecordingDraft) -> list[int]:
    return [e.open.session_id for e in draft.events if e.HasField("open")]


def placed_on(pool: DraftPool, draft: RecordingDraft) -> set[int]:
    return {sid for sid, member in pool.home.items() if member.connection is draft}


def go_down(draft: RecordingDraft, state: str = "disconnected") -> None:
    """What a connection does when its stream ends: its sessions' chains are void, then the pool is told."""
    draft._stream_down()
    draft._went_down(state, "killed")


def test_a_faster_draft_adds_more_and_an_unmeasured_one_is_assumed_as_fast_as_the_best():
    slow, fast, new = DraftView("slow"), DraftView("fast"), DraftView("new")
    slow.pace.observe(1, 0.2)   # 5 drafts a second
    fast.pace.observe(1, 0.02)  # 50, capped by the session's demand
    assert worth(fast, 1, DEMAND, 0.05, 0.7) == pytest.approx(0.7 * DEMAND)
    assert worth(slow, 1, DEMAND, 0.05, 0.7) == pytest.approx(0.7 * 5)
    assert choose([slow, fast], DEMAND).name == "fast"
    # The unknown draft is given the best known pace, so it is tried (ties: fewer sessions, then the name).
    fast.sessions = 1
    assert choose([slow, fast, new], DEMAND).name == "new"


def test_a_draft_judged_off_or_full_gets_no_session_and_a_loaded_slow_draft_gives_one_to_a_fast_one():
    a, b = DraftView("a"), DraftView("b")
    a.pace.observe(4, 0.2)
    a.sessions = 4
    assert better_home(a, [a, b], DEMAND) is b  # b (unknown: as fast as a at one session) adds what a loses
    b.judged_off = True
    assert better_home(a, [a, b], DEMAND) is None and choose([a, b], DEMAND).name == "a"
    b.judged_off, b.room = False, 0
    assert choose([a, b], DEMAND).name == "a"
    a.room = 0
    assert choose([a, b], DEMAND) is None


def test_sessions_spread_over_two_drafts_each_opened_only_where_it_is_placed():
    a, b = RecordingDraft("a"), RecordingDraft("b")
    pool, _ = pool_of(a, b)
    sessions = [session(i) for i in range(1, 5)]
    for s in sessions:
        pool.register(s)
    assert len(placed_on(pool, a)) == len(placed_on(pool, b)) == 2
    assert set(opened(a)) == placed_on(pool, a) and set(opened(b)) == placed_on(pool, b)
    # A session's events go to its own draft only.
    sid = min(placed_on(pool, a))
    pool.send(pb.TargetEvent(commit=pb.Commit(session_id=sid, start=3, tokens=[7])))
    assert any(e.HasField("commit") for e in a.events) and not any(e.HasField("commit") for e in b.events)
    pool.unregister(sid)
    assert a.events[-1].HasField("close") and sid not in pool.home


def test_a_lost_draft_s_sessions_open_at_once_on_the_other_with_their_committed_tokens_and_its_switch():
    a, b = RecordingDraft("a"), RecordingDraft("b")
    pool, _ = pool_of(a, b)
    sessions = {i: session(i) for i in range(1, 5)}
    for s in sessions.values():
        pool.register(s)
    lost = placed_on(pool, a)
    for sid in lost:  # a's chains arrive, then a dies
        sessions[sid].on_chunk(ChainChunk(epoch=0, start=3, tokens=[9, 9], dists=[]))
        sessions[sid].committed.append(5)
    go_down(a)
    assert placed_on(pool, b) == set(sessions) and all(pool.serves(sid) for sid in sessions)
    b_switch = pool.members[1].switch
    for sid in lost:
        reopen = [e.open for e in b.events if e.HasField("open") and e.open.session_id == sid]
        assert reopen and list(reopen[-1].committed) == [1, 2, 3, 5]
        assert not sessions[sid].chain.has_pending()  # nothing a's chain said is verified after the move
        assert sessions[sid].switch is b_switch and sessions[sid].stats.draft == "b"
    assert pool.moves == len(lost)


def test_with_no_draft_up_sessions_wait_unplaced_and_are_placed_when_one_comes_up():
    a = RecordingDraft("a")
    a.state = "disconnected"
    pool, _ = pool_of(a)
    s = session(1)
    pool.register(s)
    assert not pool.serves(1) and pool.state == "disconnected"
    a.state = "connected"
    pool.rebalance()
    assert pool.serves(1) and opened(a) == [1]


def test_an_incompatible_draft_takes_nothing_and_the_pool_says_which_failed():
    good, bad = RecordingDraft("good"), RecordingDraft("bad")
    pool, _ = pool_of(good, bad)
    go_down(bad, "incompatible")
    for i in range(1, 4):
        pool.register(session(i))
    assert placed_on(pool, good) == {1, 2, 3} and not opened(bad)
    assert pool.state == "connected" and "bad: killed" in pool.last_error
    assert {d["address"]: d["state"] for d in pool.describe()} == {"good": "connected", "bad": "incompatible"}


def test_a_draft_that_joins_takes_sessions_from_a_slow_loaded_one_one_move_a_tick_without_flapping():
    slow = RecordingDraft("slow")
    pool, clock = pool_of(slow)
    for i in range(1, 5):
        pool.register(session(i))
    pool.members[0].view.pace.observe(4, 0.2)  # 5 drafts a second per session at 4 sessions: behind the demand
    fast = RecordingDraft("fast")
    pool.add(fast)
    pool.members[1].view.pace.observe(1, 0.01)
    clock.now += placement.MOVE_COOLDOWN_S
    moved = []
    for _ in range(6):
        before = set(placed_on(pool, fast))
        pool.rebalance()
        moved.append(len(placed_on(pool, fast)) - len(before))
        clock.now += 0.5
    assert max(moved) == 1 and sum(moved) >= 2  # one move a tick, and the fast draft took sessions
    # Placed where they add most, they stay: more ticks move nothing back and forth.
    settled = dict((sid, m.name) for sid, m in pool.home.items())
    for _ in range(20):
        clock.now += 1.0
        pool.members[1].view.pace.observe(len(placed_on(pool, fast)), 0.01)
        pool.rebalance()
    assert dict((sid, m.name) for sid, m in pool.home.items()) == settled


def test_a_full_draft_s_refusal_places_the_session_elsewhere_and_it_gets_none_for_a_while():
    a, b = RecordingDraft("a"), RecordingDraft("b")
    pool, clock = pool_of(a, b)
    s = session(1)
    pool.register(s)
    first = pool.home[1].connection
    other = b if first is a else a
    first.on_event(pb.DraftEvent(error=pb.SessionError(session_id=1, message="the draft holds 8 sessions already "
                                                                           "(duo-draft --max-sessions 8)")))
    assert pool.home[1].connection is other and not s.draft_refused  # re-opened there
    pool.register(session(2))
    assert pool.home[2].connection is other  # the full one is offered nothing ...
    clock.now += ROOM_RETRY_S + 1
    pool.register(session(3))
    assert pool.home[3].connection is first  # ... until its room may have come back


def test_a_session_a_draft_refused_for_its_own_fault_is_not_offered_to_that_draft_again():
    a, b = RecordingDraft("a"), RecordingDraft("b")
    pool, _ = pool_of(a, b)
    pool.register(session(1))
    first = pool.home[1].connection
    first.on_event(pb.DraftEvent(error=pb.SessionError(session_id=1, message="the grammar does not compile")))
    second = pool.home[1].connection
    assert second is not first
    second.on_event(pb.DraftEvent(error=pb.SessionError(session_id=1, message="the grammar does not compile")))
    assert pool.home[1].connection is second  # nowhere else to go: it stays, refused (it decodes alone)


def test_a_draft_judged_off_hands_its_sessions_to_one_that_pays():
    a, b = RecordingDraft("a"), RecordingDraft("b")
    pool, clock = pool_of(a, b)
    for i in range(1, 5):
        pool.register(session(i))
    on_a = placed_on(pool, a)
    pool.members[0].switch = Switch(speculating=False, gain=0.8)  # a's last judgement: 0.8x decoding alone
    clock.now += placement.MOVE_COOLDOWN_S
    for _ in range(len(on_a)):
        pool.rebalance()
    assert placed_on(pool, b) == set(range(1, 5))
    # Idle and off, a gets a fresh trial after a while: it is offered sessions again and judged on them.
    clock.now += RETRIAL_S
    pool.rebalance()
    clock.now += RETRIAL_S
    pool.register(session(5))
    assert pool.members[0].switch.speculating and pool.home[5].connection is a


def test_each_draft_judges_its_own_sessions_against_the_targets_one_reference_at_the_targets_load():
    target = Target(None, ModelWorker(), drafts=True, n_ctx=256, settings=SpecSettings())
    a, b = RecordingDraft("a"), RecordingDraft("b")
    target.pool.add(a)
    target.pool.add(b)
    switch_a, switch_b = (m.switch for m in target.pool.members)
    assert switch_a.rest_rates is target.control.switch.rest_rates is switch_b.rest_rates
    assert switch_a.rest_contexts is target.control.switch.rest_contexts is switch_b.rest_contexts
    first, second = session(1), session(2)
    target.pool.register(first)
    target.pool.register(second)
    assert {id(first.switch), id(second.switch)} == {id(switch_a), id(switch_b)}
    first.switch.step_done(1, 1, 0)
    second.switch.step_done(2, 1, 0)
    # Each switch saw one request step, yet the load either judges at is the target's: two.
    assert switch_a.requests == switch_b.requests == 1 and switch_a._load_now() == switch_b._load_now() == 2
    assert target.control.any_speculating()


def test_the_pool_stops_its_dialing_tasks_when_it_stops():
    async def run() -> bool:
        pool = DraftPool(Switch, lambda: DEMAND)
        dialing = asyncio.Event()

        async def dial() -> None:
            dialing.set()
            await asyncio.sleep(3600)

        member = pool.add(RecordingDraft("a"), run=dial)
        running = asyncio.ensure_future(pool.run())
        await dialing.wait()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        return member.dialing.cancelled() and not pool.members

    assert asyncio.run(run())


def test_a_draft_that_breaks_bounds_hands_its_sessions_over_and_gets_none_for_a_while():
    good, hostile = RecordingDraft("good"), RecordingDraft("hostile")
    pool, clock = pool_of(good, hostile)
    sessions = {i: session(i) for i in range(1, 5)}
    for s in sessions.values():
        pool.register(s)
    on_hostile = placed_on(pool, hostile)
    sid = min(on_hostile)
    hostile.vocab = type("V", (), {"n_vocab": 100})()
    hostile.on_event(pb.DraftEvent(chunk=pb.DraftChunk(session_id=sid, epoch=0, start=3, tokens=[10 ** 6])))
    assert hostile.faults == 1 and not sessions[sid].chain.has_pending()  # cut by the bounds
    clock.now += placement.MOVE_COOLDOWN_S
    for _ in range(len(on_hostile)):
        pool.rebalance()
    assert placed_on(pool, good) == set(sessions)
    pool.register(session(5))
    assert pool.home[5].connection is good
    clock.now += FAULTY_FOR_S
    pool.register(session(6))
    assert pool.home[6].connection is hostile  # no fault for a while: offered sessions again


def test_the_allow_list_reads_addresses_and_networks_and_checks_grpcs_peer_strings():
    networks = parse_allow(["10.0.0.0/8", "192.168.1.7", "::1"])
    assert peer_host("ipv4:10.1.2.3:5000") == "10.1.2.3" and peer_host("ipv6:[::1]:5000") == "::1"
    assert allowed("ipv4:10.1.2.3:5000", networks) and allowed("ipv4:192.168.1.7:1", networks)
    assert allowed("ipv6:[::1]:5000", networks)
    assert not allowed("ipv4:192.168.1.8:1", networks) and not allowed("unix:/tmp/x", networks)
    assert allowed("ipv4:8.8.8.8:1", [])  # no list: anyone (mutual TLS may still guard the port)
    with pytest.raises(ValueError, match="--draft-allow 'nonsense'"):
        parse_allow(["nonsense"])


def test_acceptance_counts_the_accepted_tokens_and_the_first_rejected_one_never_those_after_it():
    view = DraftView("a")
    view.observe_acceptance(verified=4, accepted=1)  # accepted, rejected; the last two were never judged
    view.observe_acceptance(verified=2, accepted=2)
    # Four tokens judged, three accepted (a moving average: equal weights so far but for its decay).
    assert view.acceptance.value == pytest.approx(0.75, abs=0.03)
    assert view.acceptance.weight == pytest.approx(sum(0.95 ** i for i in range(4)))


def test_a_draft_too_slow_to_be_timed_is_taken_as_one_token_a_step_and_a_timed_fast_one_gets_its_sessions():
    slow, fast = RecordingDraft("slow"), RecordingDraft("fast")
    clock = Clock(100.0)
    pool = DraftPool(Switch, lambda: DEMAND, clock=clock, step_seconds=lambda: 0.2)
    pool.add(slow)
    for i in range(1, 5):
        pool.register(session(i))
    pool.add(fast)
    pool.members[1].view.pace.observe(1, 0.01)
    assert not pool.members[0].view.pace.measured  # untimed: assumed as fast as the best, for now
    for _ in range(8):
        clock.now += 1.0  # served its sessions UNTIMED_GRACE_S without a pace: one token a step at best
        pool.rebalance()
    assert pool.members[0].view.pace.measured
    assert pool.members[0].view.pace.seconds_per_token(len(placed_on(pool, slow)) or 1) >= 0.2 * 0.25
    assert len(placed_on(pool, fast)) >= 3
