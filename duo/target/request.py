"""What a request to the target is, and what the target reports of it: its settings, steps and counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from duo.constraint import Cursor
from duo.sampling.ops.penalties import Penalties
from duo.sampling.params import SamplingParams
from duo.sampling.verification import COUPLED, GREEDY, RESIDUAL


@dataclass(frozen=True)
class SpecSettings:
    """How much speculation to use (the names llama.cpp users know).

    Adaptive (the default): each step verifies the number of pending drafts, up to draft_max, that
    the measured costs and acceptance say is fastest, and the draft is steered to run just far
    enough ahead. Fixed: every step verifies min(pending, draft_max) drafts.
    """

    draft_max: int = 16     # most chain tokens verified in one target batch
    draft_min: int = 0      # fewer pending tokens than this: decode alone
    draft_p_min: float = 0.0  # the draft proposes nothing where its top-1 probability is below this
    max_ahead: int = 32     # how far beyond the committed tokens the draft may run (fixed mode)
    adaptive: bool = True
    # > 0: the classic synchronous loop, for comparison: each step waits for this many drafts, and
    # the draft, allowed no further ahead, idles while the target verifies.
    sync: int = 0
    # How sampled requests without a seed are verified (seeded ones are always coupled, so that the
    # seed alone decides the output): COUPLED with a seed the target draws, or RESIDUAL.
    unseeded: str = RESIDUAL
    lookup: bool = True  # propose what follows a repeated n-gram of the context as free drafts (duo.lookup)

    @property
    def max_lead(self) -> int:
        """The furthest ahead of the committed tokens the draft is ever told to run: the fixed lead, or the
        adaptive policy's 2 draft_max + 2 (duo.target.policy.AdaptivePolicy.max_ahead)."""
        return max(self.max_ahead, 2 * self.draft_max + 2)


@dataclass
class StepTimes:
    """Where a request's decode time goes, from its first token to its end (seconds, summed over its steps).

    The first six add up to that time: each step after the first token is the wait for drafts before it
    (`drafts`), duo's own work on the event loop (`work`: planning, building the batch, committing, telling the
    draft), its wait in the batcher for the call (`queue`: the others' steps gathered, other work ahead on the model
    thread) and the call: llama.cpp's decode of the whole batch (`verify`), then the verification of its rows on the
    model thread (`check`: sampling, penalties, the rollback; every request's in the call); `between` is the rest
    (after a step until the next: the event loop, the client taking its tokens). `round_trips`: commits that
    left the request without drafts, and `round_trip` the seconds until the draft's next chain came (the commit's
    trip to the draft and its answer, as the target sees it): it overlaps the others, which the target did meanwhile.
    """

    verify: float = 0.0
    check: float = 0.0
    work: float = 0.0
    drafts: float = 0.0
    queue: float = 0.0
    between: float = 0.0
    round_trips: int = 0
    round_trip: float = 0.0

    @property
    def decode(self) -> float:
        """The time the parts cover: from the first token to the end."""
        return self.verify + self.check + self.work + self.drafts + self.queue + self.between

    def add_step(self, *, drafts: float, work: float, queue: float, verify: float, check: float,
                 between: float) -> None:
        self.drafts += drafts
        self.work += work
        self.queue += queue
        self.verify += verify
        self.check += check
        self.between += between

    def fields(self) -> dict[str, float | int]:
        """Under the names of proto/duo.proto's Stats message."""
        return {"step_verify_seconds": self.verify, "step_check_seconds": self.check, "step_work_seconds": self.work,
                "step_drafts_seconds": self.drafts, "step_queue_seconds": self.queue,
                "step_between_seconds": self.between, "commit_round_trips": self.round_trips,
                "commit_round_trip_seconds": self.round_trip}


@dataclass
class GenerationStats:
    """One request's counters and times (time.monotonic()).

    Time to first token runs from the request's arrival, queueing included (as vLLM and OpenAI
    count it); tokens per second from the start of its generation, so that it measures decoding.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # the prompt's prefix that was in the cache already (not decoded again)
    generated_tokens: int = 0
    draft_tokens_received: int = 0
    draft_tokens_verified: int = 0
    draft_tokens_accepted: int = 0
    draft_rejections: int = 0  # steps that rejected a draft token
    lookup_tokens_verified: int = 0  # of the drafts verified, those proposed by the context lookup
    lookup_tokens_accepted: int = 0
    # What the lookup cost and why (duo.target.lookup_policy): lookup tokens decoded in verify batches (the others it
    # verified were checked by a row the step decoded anyway), steps whose proposals it held out of the batch, rests
    # that ended in a trial, and where it stands.
    lookup_tokens_decoded: int = 0
    lookup_steps_rested: int = 0
    lookup_trials: int = 0
    lookup: str = ""
    branch_hits: int = 0       # rejections after which a branch held the committed token
    waits: int = 0             # steps that waited for drafts known to be coming
    wait_seconds: float = 0.0
    verification: str = GREEDY  # GREEDY, COUPLED or RESIDUAL (duo.sampling)
    speculation: str = ""       # whether the adaptive policy speculates, and why (duo.target.switch.Switch.reason)
    draft: str = ""             # the draft that served it last (its address; duo.target.pool), "" for none
    seed: int = 0               # a sampled request's seed, drawn by the target when the client gave none
    verify_steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # [n]: steps that decoded n tokens at once
    times: StepTimes = field(default_factory=StepTimes)  # where the decode time went
    started: float = field(default_factory=time.monotonic)
    arrived: float = field(default_factory=time.monotonic)  # when the request came in
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def tokens_per_second(self) -> float:
        elapsed = (self.finished_at or time.monotonic()) - self.started
        return self.generated_tokens / elapsed if elapsed > 0 else 0.0

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first token; None before it."""
        return None if self.first_token_at is None else self.first_token_at - self.arrived

    def fields(self, draft_connected: bool) -> dict[str, float | int | bool | str | list[int]]:
        """The stats under the names of proto/duo.proto's Stats message (also HTTP's duo_stats)."""
        return {"prompt_tokens": self.prompt_tokens, "cached_prompt_tokens": self.cached_prompt_tokens,
                "generated_tokens": self.generated_tokens, "draft_tokens_received": self.draft_tokens_received,
                "draft_tokens_verified": self.draft_tokens_verified,
                "draft_tokens_accepted": self.draft_tokens_accepted, "verify_steps": self.verify_steps,
                "tokens_per_second": self.tokens_per_second,
                "time_to_first_token_s": self.time_to_first_token or 0.0, "draft_connected": draft_connected,
                "batch_sizes": list(self.batch_sizes), "draft_rejections": self.draft_rejections,
                "branch_hits": self.branch_hits, "waits": self.waits, "wait_seconds": self.wait_seconds,
                "verification": self.verification, "seed": self.seed, "speculation": self.speculation,
                "lookup_tokens_verified": self.lookup_tokens_verified,
                "lookup_tokens_accepted": self.lookup_tokens_accepted,
                "lookup_tokens_decoded": self.lookup_tokens_decoded, "lookup_steps_rested": self.lookup_steps_rested,
                "lookup_trials": self.lookup_trials, "lookup": self.lookup, "draft": self.draft,
                **self.times.fields()}

    def count_lookup(self, rows: int | None, trials: int, state: str) -> None:
        """A step's lookup: `rows` of its tokens decoded (None: it proposed none; 0: its proposals were held out)."""
        if rows is not None:
            self.lookup_tokens_decoded += rows
            self.lookup_steps_rested += rows == 0
        self.lookup_trials, self.lookup = trials, state

    def log_line(self, finish: str) -> str:
        """The finished request's line for the target's log, as llama-server prints its timings; `finish`: its
        finish reason, or why it has none."""
        ttft = self.time_to_first_token
        drafts = (f"accepted {self.draft_tokens_accepted}/{self.draft_tokens_verified} drafts"
                  if self.draft_tokens_verified else "no drafts verified")
        if self.lookup_tokens_verified:
            drafts += (f" ({self.lookup_tokens_accepted}/{self.lookup_tokens_verified} from the context, "
                       f"{self.lookup_tokens_decoded} decoded; lookup held out in {self.lookup_steps_rested} steps, "
                       f"{self.lookup_trials} trials, {self.lookup})")
        speculation = f", speculation {self.speculation}" if self.speculation else ""
        if self.draft:
            drafts += f" from draft {self.draft}"
        return (f"request done ({finish}): {self.generated_tokens} tokens at {self.tokens_per_second:.2f} tok/s, "
                f"first token after {'-' if ttft is None else f'{ttft:.2f} s'}, {drafts} in {self.verify_steps} "
                f"steps, prompt {self.prompt_tokens} tokens ({self.cached_prompt_tokens} cached){speculation}")


@dataclass(frozen=True)
class Request:
    prompt_tokens: list[int]
    params: SamplingParams
    seed: int | None = None
    max_tokens: int = 0  # 0: until end of generation or a full context
    cache_prompt: bool = True  # False: shares no prompt prefix with other requests, either way
    arrived: float = field(default_factory=time.monotonic)  # for the time to first token
    # The output's grammar (llguidance's JSON, sent to the draft) and the target's cursor on it, compiled for
    # its vocabulary (duo.constraint); None: free text. The generation owns the cursor.
    grammar: str = ""
    constraint: Cursor | None = None
    penalties: Penalties = Penalties()  # transforms of each position's logits by the output before it
    logprobs: int = -1  # >= 0: report each token's log-probability and this many alternatives'
    post_sampling: bool = False  # ... under the distribution it was drawn from, after the whole chain


def verification_of(request: Request, unseeded: str) -> str:
    """GREEDY at temperature 0; COUPLED for a seeded request (the same seed gives the same text, draft
    or not); `unseeded` for the others."""
    if request.params.greedy:
        return GREEDY
    return COUPLED if request.seed is not None else unseeded


# Where a committed token came from: an accepted draft of the draft model, of the grammar (the text it forces), of
# the context lookup (duo.lookup), or the target's own token (recovered after a rejection, a bonus, or decoded alone).
DRAFT, GRAMMAR, LOOKUP, TARGET = "draft", "grammar", "lookup", "target"
SOURCES = (DRAFT, GRAMMAR, LOOKUP, TARGET)


@dataclass(frozen=True)
class Step:
    """Tokens committed by one target step; `finish_reason` is set on the last step."""

    tokens: list[int]
    finish_reason: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per token, where the request asked
    sources: tuple[str, ...] = ()  # per token, one of SOURCES (empty: not known, as a step made elsewhere)

    @staticmethod
    def sources_of(split: tuple[int, int, int], n_accepted: int, n_tokens: int) -> tuple[str, ...]:
        """The sources of a step's `n_tokens` committed tokens: its `n_accepted` accepted drafts, which are in the
        order of `split` (how many of the verified drafts came from the model's chain, the grammar, the lookup), then
        the target's own. E.g. split (2, 0, 3) with 4 accepted: draft, draft, lookup, lookup, target."""
        chain, forced, _ = split
        drafts = (DRAFT if i < chain else GRAMMAR if i < chain + forced else LOOKUP for i in range(n_accepted))
        return (*drafts, TARGET)[:n_tokens]


@dataclass(frozen=True)
class StepRecord:
    """What one verify step did: for the adaptive policy, stats and metrics."""

    batch_size: int   # tokens decoded in one batch (1: decoding alone)
    n_verified: int   # draft tokens verified (can be batch_size, the last one checked by the bonus row)
    n_accepted: int   # of which accepted: always a prefix of the chain
    n_committed: int  # tokens committed (accepted + recovered or bonus; fewer at a stop)
    seconds: float    # decode + verification time
    waited: float = 0.0  # seconds this step waited for drafts before it (0: it did not wait)
