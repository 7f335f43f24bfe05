"""Where a session drafts: each draft's worth to the whole target, from what was measured of it.

A draft serves its sessions in rounds (one batched model call drafts a token for every session with
work, duo.draft.service), so at s sessions each one gets a drafted token every d(s) seconds, d(s) its
measured seconds per token at that load. A token is worth something only if the target accepts it
(the draft's measured acceptance a on this target) and only as fast as the target can verify it: one
session takes at most `demand` drafts a second (its share of the target's verify steps). So a draft
serving s sessions adds

    W(s) = a * s * min(1 / (d(s) + l / CHAIN), demand)        accepted drafts per second

to the target, l the measured latency of a restart after a rejection (the link's round trip and a draft step,
paid once per chain of about CHAIN drafts); a draft its switch judged off adds nothing. A new
session goes to the draft whose W grows most by taking it; a running session moves when its draft's
loss is clearly smaller than another's gain (MOVE_MARGIN), and not again for MOVE_COOLDOWN_S: a move
costs the new draft a prefill of the session's committed tokens.

d(s) at a load never measured is the nearest measured load's, scaled by s / s' (a round's cost grows at
most in proportion to its sessions: the conservative side); a draft measured at no load yet is assumed
as fast as the best one known, with the pool's mean acceptance, so that it gets sessions and is measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from duo.costs import MovingAverage

CHAIN = 4               # drafts per chain between rejections, for the link's share of a token's time
UNKNOWN_D = 0.05        # seconds per token of a draft when no draft of the pool was measured yet
UNKNOWN_ACCEPTANCE = 0.7  # acceptance of a draft when none was measured yet
MOVE_MARGIN = 0.15      # a move must raise the pool's worth by this share of the moved session's
MOVE_COOLDOWN_S = 5.0   # a session moves at most this often


@dataclass
class DraftPace:
    """One draft's measured seconds per drafted token per session, by its load then (sessions served)."""

    by_load: dict[int, MovingAverage] = field(default_factory=dict)

    def observe(self, load: int, seconds_per_token: float) -> None:
        load = max(1, load)
        self.by_load.setdefault(load, MovingAverage(seconds_per_token)).add(seconds_per_token)

    @property
    def measured(self) -> bool:
        return bool(self.by_load)

    def seconds_per_token(self, load: int) -> float | None:
        """d(load): measured there, else the nearest measured load's scaled by the loads' ratio (None: none)."""
        load = max(1, load)
        if load in self.by_load:
            return self.by_load[load].value
        if not self.by_load:
            return None
        nearest = min(self.by_load, key=lambda measured: (abs(measured - load), measured))
        return self.by_load[nearest].value * load / nearest


@dataclass
class DraftView:
    """What placement knows of one draft: its pace, acceptance on this target, link delay and sessions."""

    name: str
    pace: DraftPace = field(default_factory=DraftPace)
    acceptance: MovingAverage = field(default_factory=lambda: MovingAverage(UNKNOWN_ACCEPTANCE))
    delay_s: float = 0.0   # the link's one-way delay (half the handshake's round trip)
    sessions: int = 0      # placed on it now
    room: int | None = None  # sessions it can still take (None: unknown; 0 after it refused one for capacity)
    judged_off: bool = False  # its switch found it does not beat decoding alone, or it broke bounds lately

    def observe_acceptance(self, verified: int, accepted: int) -> None:
        """A step verified `verified` of this draft's tokens and accepted the first `accepted`: each accepted token
        and the first rejected one were judged; those after it never were (the per-token acceptance a is the chance
        a token is accepted where it is reached, as duo.target.policy counts it)."""
        for i in range(min(verified, accepted + 1)):
            self.acceptance.add(1.0 if i < accepted else 0.0)


def _d(view: DraftView, load: int, fallback_d: float) -> float:
    measured = view.pace.seconds_per_token(load)
    return measured if measured is not None else fallback_d * max(1, load)


def worth(view: DraftView, load: int, demand: float, fallback_d: float, fallback_a: float) -> float:
    """W(load): accepted drafts per second the draft adds to the target serving `load` sessions."""
    if load <= 0 or view.judged_off:
        return 0.0
    acceptance = view.acceptance.value if view.acceptance.weight > 0 else fallback_a
    per_session = 1.0 / (_d(view, load, fallback_d) + view.delay_s / CHAIN)
    return acceptance * load * min(per_session, demand)


@dataclass(frozen=True)
class Fallbacks:
    """What an unmeasured draft is assumed to be: the best measured pace, the mean measured acceptance."""

    d: float
    acceptance: float

    @staticmethod
    def of(views: list[DraftView]) -> Fallbacks:
        paces = [p for v in views if (p := v.pace.seconds_per_token(1)) is not None]
        accepted = [v.acceptance.value for v in views if v.acceptance.weight > 0]
        return Fallbacks(min(paces) if paces else UNKNOWN_D,
                         sum(accepted) / len(accepted) if accepted else UNKNOWN_ACCEPTANCE)


def gain_of_adding(view: DraftView, demand: float, fallbacks: Fallbacks) -> float:
    return (worth(view, view.sessions + 1, demand, fallbacks.d, fallbacks.acceptance)
            - worth(view, view.sessions, demand, fallbacks.d, fallbacks.acceptance))


def loss_of_removing(view: DraftView, demand: float, fallbacks: Fallbacks) -> float:
    return (worth(view, view.sessions, demand, fallbacks.d, fallbacks.acceptance)
            - worth(view, view.sessions - 1, demand, fallbacks.d, fallbacks.acceptance))


def has_room(view: DraftView) -> bool:
    return view.room is None or view.room > 0


def choose(views: list[DraftView], demand: float, exclude: frozenset[str] = frozenset()) -> DraftView | None:
    """The draft a new session adds the most to (ties: _rank), None if none can take it."""
    open_views = [v for v in views if v.name not in exclude and has_room(v)]
    if not open_views:
        return None
    fallbacks = Fallbacks.of(views)
    return max(open_views, key=lambda v: _rank(v, demand, fallbacks))


def _rank(view: DraftView, demand: float, fallbacks: Fallbacks) -> tuple[float, bool, int, str]:
    """Most added first; among equals, a draft not judged off, then the fewest sessions, then the name."""
    # Rounded: drafts of equal worth differ by float noise, which must not outrank the fewer sessions.
    return round(gain_of_adding(view, demand, fallbacks), 9), not view.judged_off, -view.sessions, view.name


def better_home(source: DraftView, views: list[DraftView], demand: float) -> DraftView | None:
    """Where one of `source`'s sessions would add clearly more than it adds where it is (None: stay)."""
    if source.sessions <= 0:
        return None
    fallbacks = Fallbacks.of(views)
    loss = loss_of_removing(source, demand, fallbacks)
    others = [v for v in views if v is not source and has_room(v)]
    if not others:
        return None
    best = max(others, key=lambda v: _rank(v, demand, fallbacks))
    if source.judged_off and not best.judged_off:
        return best  # drafts that do not pay there may pay here: its switch will say
    gain = gain_of_adding(best, demand, fallbacks)
    return best if gain - loss > MOVE_MARGIN * max(loss, 1e-9) else None
