"""Prometheus metrics of duo-target, named like vLLM's so that existing dashboards and alerts carry over, and
llama-server's (llamacpp:*, duo.api.serving.llama_metrics) beside them.

Vocabulary (vLLM's): a *draft* is one verify step that checked at least one draft token; its
*draft tokens* are the tokens it checked; *accepted tokens* the prefix of them the target kept.
num_accepted_tokens_per_pos{position="i"} counts acceptances at chain position i (0 = the first
draft token of a step), so per_pos[i] / num_drafts is the acceptance rate at depth i.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from duo.api.serving.llama_metrics import LlamaCppMetrics
from duo.target.request import GenerationStats, StepRecord
from duo.net.wire import REJECTION_REASONS

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds; spans a tiny model's milliseconds to a long generation on a CPU.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# Requests and tokens in one model call of the target (every running request's step in one batch).
CALL_REQUEST_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
CALL_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
# The draft link's states; "none": no --peer, or the model is still loading.
DRAFT_STATES = ("connected", "disconnected", "incompatible", "none")


class Metrics:
    """duo-target's metrics in a registry of their own (not prometheus_client's global one), and llama-server's."""

    def __init__(self) -> None:
        self.started = int(time.time())  # the Unix time llama-server's /metrics sends as Process-Start-Time-Unix
        self.registry = CollectorRegistry()
        self.llamacpp = LlamaCppMetrics(self.registry)
        r = self.registry
        self.waits = Counter("duo:spec_decode_waits", "Steps that waited for drafts known to be coming instead of "
                             "decoding alone.", registry=r)
        self.wait_seconds = Counter("duo:spec_decode_wait_seconds", "Time those steps waited.", registry=r)
        self.branch_hits = Counter("duo:spec_decode_branch_hits", "Rejections after which a branch of the draft's "
                                   "held the committed token (its drafts verified at once).", registry=r)
        self.num_drafts = Counter("duo:spec_decode_num_drafts", "Verify steps that checked draft tokens.",
                                  registry=r)
        self.num_draft_tokens = Counter("duo:spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.num_accepted_tokens = Counter("duo:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                           registry=r)
        self.accepted_per_pos = Counter("duo:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each chain position of a step.", ["position"],
                                        registry=r)
        self.generation_tokens = Counter("duo:generation_tokens", "Tokens generated.", registry=r)
        # As the target steps (duo:generation_tokens counts a request's tokens when it ends): live rates, for the
        # page at / (duo/api/page) and dashboards.
        self.num_steps = Counter("duo:spec_decode_num_steps", "Verify steps of the target, with drafts or alone.",
                                 registry=r)
        self.num_emitted_tokens = Counter("duo:spec_decode_num_emitted_tokens", "Tokens the target's steps committed: "
                                          "accepted drafts and the target's own.", registry=r)
        # Per verification mode (greedy, coupled, residual), to compare their acceptance in production.
        self.requests_by_verification = Counter("duo:requests_by_verification", "Requests that ran, by how their "
                                                "drafts were verified.", ["verification"], registry=r)
        self.verified_by_verification = Counter("duo:draft_tokens_verified_by_verification", "Draft tokens "
                                                "verified, by verification mode.", ["verification"], registry=r)
        self.accepted_by_verification = Counter("duo:draft_tokens_accepted_by_verification", "Draft tokens "
                                                "accepted, by verification mode.", ["verification"], registry=r)
        self.prompt_tokens = Counter("duo:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.prompt_tokens_cached = Counter("duo:prompt_tokens_cached", "Prompt tokens found in the cache "
                                            "(a shared prefix): reused, not decoded.", registry=r)
        self.request_success = Counter("duo:request_success", "Requests that finished, by finish reason.",
                                       ["finish_reason"], registry=r)
        self.e2e_latency = Histogram("duo:e2e_request_latency_seconds",
                                     "From arrival (queueing included) to the last token.",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("duo:time_to_first_token_seconds",
                                             "From arrival (queueing included) to the first token.",
                                             buckets=TTFT_BUCKETS, registry=r)
        self.draft_connected = Gauge("duo:draft_connected", "1 while a draft is connected, else 0.", registry=r)
        self.draft_state = Gauge("duo:draft_state", "1 for the draft link's current state, 0 for the others.",
                                 ["state"], registry=r)
        self.draft_rejected_entries = Counter(
            "duo:draft_rejected_entries", "Chain entries from the draft dropped for breaking a bound, by reason "
            "(epoch, position, lead, token, distribution, length).", ["reason"], registry=r)
        for reason in REJECTION_REASONS:
            self.draft_rejected_entries.labels(reason=reason)  # exported at 0 before the first one
        self.draft_len = Gauge("duo:spec_decode_draft_len",
                               "Draft tokens per step: the adaptive policy's current choice, or --draft-max.",
                               registry=r)
        self.spec_on = Gauge("duo:spec_decode_on", "1 while the adaptive policy speculates, 0 while the draft rests "
                             "because speculation did not beat decoding alone (duo.target.switch).", registry=r)
        self.spec_gain = Gauge("duo:spec_decode_gain", "Why: tokens per wall second speculating over decoding alone, "
                               "as last judged (0: not judged yet). A trial must reach 1.05 to turn speculation on; "
                               "once on, it stays on while at least 1.0.", registry=r)
        self.requests_running = Gauge("duo:num_requests_running", "Generations running.", registry=r)
        self.requests_waiting = Gauge("duo:num_requests_waiting", "Requests waiting for a turn.", registry=r)
        self.iteration_requests = Histogram("duo:iteration_requests", "Requests whose step (or prompt chunk) one "
                                            "model call decoded together.", buckets=CALL_REQUEST_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("duo:iteration_tokens_total", "Tokens one model call decoded (every "
                                          "request's verify batch and prompt chunk).", buckets=CALL_TOKEN_BUCKETS,
                                          registry=r)
        self.client_write_timeouts = Counter("duo:client_write_timeouts",
                                             "Streaming clients dropped for reading nothing for --write-timeout.",
                                             registry=r)

    def watch(self, *, draft_state: Callable[[], str], draft_len: Callable[[], float], spec_on: Callable[[], float],
              spec_gain: Callable[[], float], running: Callable[[], float], waiting: Callable[[], float]) -> None:
        """Read the gauges from these functions at every scrape."""
        self.draft_connected.set_function(lambda: float(draft_state() == "connected"))
        for state in DRAFT_STATES:
            self.draft_state.labels(state=state).set_function(lambda state=state: float(draft_state() == state))
        self.draft_len.set_function(draft_len)
        self.spec_on.set_function(spec_on)
        self.spec_gain.set_function(spec_gain)
        self.requests_running.set_function(running)
        self.requests_waiting.set_function(waiting)
        self.llamacpp.running, self.llamacpp.waiting = running, waiting

    def watch_drafts(self, drafts: Callable[[], list[dict]]) -> None:
        """Export each draft of the pool (duo.target.pool.pool.Member.describe) at every scrape, labelled by its
        address: drafts come and go, so the series are built from the pool as it is, none left behind."""
        self.registry.register(DraftCollector(drafts))

    # duo.target.target.StepObserver
    def on_step(self, record: StepRecord) -> None:
        self.num_steps.inc()
        self.num_emitted_tokens.inc(record.n_committed)
        if record.waited:
            self.waits.inc()
            self.wait_seconds.inc(record.waited)
        if record.n_verified == 0:
            return
        self.num_drafts.inc()
        self.num_draft_tokens.inc(record.n_verified)
        self.num_accepted_tokens.inc(record.n_accepted)
        for position in range(record.n_accepted):
            self.accepted_per_pos.labels(position=str(position)).inc()

    # duo.target.batching.CallObserver
    def on_call(self, requests: int, tokens: int) -> None:
        self.iteration_requests.observe(requests)
        self.iteration_tokens.observe(tokens)

    # duo.target.pool.connection.DraftObserver
    def on_draft_rejected(self, reason: str, entries: int) -> None:
        self.draft_rejected_entries.labels(reason=reason).inc(entries)

    def request_finished(self, stats: GenerationStats, finish_reason: str | None) -> None:
        """Count one request that ran; `finish_reason` None: the client left before the end."""
        self.llamacpp.request_finished(stats)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.prompt_tokens_cached.inc(stats.cached_prompt_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        self.branch_hits.inc(stats.branch_hits)
        self.requests_by_verification.labels(verification=stats.verification).inc()
        self.verified_by_verification.labels(verification=stats.verification).inc(stats.draft_tokens_verified)
        self.accepted_by_verification.labels(verification=stats.verification).inc(stats.draft_tokens_accepted)
        if stats.time_to_first_token is not None:
            self.time_to_first_token.observe(stats.time_to_first_token)
        if finish_reason is not None:
            self.request_success.labels(finish_reason=finish_reason).inc()
            self.e2e_latency.observe(time.monotonic() - stats.arrived)

    def render(self) -> bytes:
        """The Prometheus text exposition format: duo's metrics, then llama-server's (whose rates start a new window
        at each render, as a scrape of llama-server's does)."""
        return generate_latest(self.registry) + self.llamacpp.render().encode()


class DraftCollector(Collector):
    """duo:pool_* gauges, one series per draft of the pool."""

    def __init__(self, drafts: Callable[[], list[dict]]) -> None:
        self.drafts = drafts

    def collect(self):  # type: ignore[override]
        families = {
            "up": GaugeMetricFamily("duo:pool_draft_up", "1 while the draft's stream is up.", labels=["draft", "model"]),
            "sessions": GaugeMetricFamily("duo:pool_draft_sessions", "Sessions placed on the draft.", labels=["draft"]),
            "pace": GaugeMetricFamily("duo:pool_draft_tokens_per_second_per_session",
                                      "Drafted tokens a second each of its sessions gets, as measured at its load.",
                                      labels=["draft"]),
            "acceptance": GaugeMetricFamily("duo:pool_draft_acceptance",
                                            "Share of the draft's tokens the target accepted (moving average).",
                                            labels=["draft"]),
            "speculating": GaugeMetricFamily("duo:pool_draft_speculating",
                                             "1 while the draft's switch has speculation on.", labels=["draft"]),
        }
        for draft in self.drafts():
            address = draft["address"]
            families["up"].add_metric([address, draft["model"]], float(draft["state"] == "connected"))
            families["sessions"].add_metric([address], float(draft["sessions"]))
            families["pace"].add_metric([address], draft["tokens_per_second_per_session"] or 0.0)
            families["acceptance"].add_metric([address], draft["acceptance"] or 0.0)
            families["speculating"].add_metric([address], float(draft["speculating"]))
        yield from families.values()
