"""Prometheus metrics of duo-draft, and the small HTTP server (`duo-draft --metrics`) that serves them.

Vocabulary: a *session* is one target generation the draft drafts for, holding a slot of sequences
in the draft's one KV cache (--kv-cells, shared by all sessions); a *connection* is one target's
Speculate stream; a *round* is one batched model call that decodes what each session with work lacks
in the cache and draws its next token (or pauses, under --draft-p-min); a *chunk* is one DraftChunk
message sent to a target.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from duo.draft.batch import RoundReport

# Seconds per round: a tiny model's tenth of a millisecond to a large draft on a CPU.
ROUND_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Sessions drafted for in one round (up to llama.cpp's 256 sequences), and tokens decoded in one (up to a batch).
SESSION_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# Why a session got a SessionError (labels of duo_draft:sessions_refused_total).
REFUSAL_REASONS = ("max_sessions", "max_sessions_per_target", "invalid_event", "model_error", "internal")


class DraftMetrics:
    """duo-draft's metrics in a registry of their own (not prometheus_client's global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions_open = Gauge("duo_draft:num_sessions_open", "Sessions holding a slot, over all targets.",
                                   registry=r)
        self.kv_cells_used = Gauge("duo_draft:kv_cells_used", "KV cells the sessions hold in the shared cache "
                                   "(duo-draft --kv-cells).", registry=r)
        self.connections = Gauge("duo_draft:num_connections", "Targets connected (open Speculate streams).",
                                 registry=r)
        self.draft_tokens = Counter("duo_draft:draft_tokens", "Tokens drafted, including those a commit made "
                                    "stale before they were sent.", registry=r)
        self.chunks_sent = Counter("duo_draft:chunks_sent", "DraftChunk messages sent to targets.", registry=r)
        self.guessed_tokens = Counter("duo_draft:guessed_tokens", "Tokens guessed from the context and decoded with a "
                                      "chain's draw (duo.draft.guess).", registry=r)
        self.guessed_tokens_kept = Counter("duo_draft:guessed_tokens_kept", "Guessed tokens the draws followed: "
                                           "drafted at no decode of their own.", registry=r)
        self.pauses = Counter("duo_draft:p_min_pauses", "Positions where the draft proposed nothing: its top-1 "
                              "probability was below the session's --draft-p-min.", registry=r)
        self.round_seconds = Histogram("duo_draft:round_seconds", "Model time of one round: one batched decode of "
                                       "what each session's cache lacks, then each one's draw.",
                                       buckets=ROUND_BUCKETS, registry=r)
        self.sessions_per_round = Histogram("duo_draft:sessions_per_round", "Sessions one round decoded for.",
                                            buckets=SESSION_BUCKETS, registry=r)
        self.tokens_per_round = Histogram("duo_draft:tokens_per_round", "Tokens one round decoded (catch-up "
                                          "after commits and prompts included).", buckets=TOKEN_BUCKETS, registry=r)
        self.sessions_refused = Counter("duo_draft:sessions_refused", "Sessions given a SessionError (their "
                                        "target decodes alone for them), by reason.", ["reason"], registry=r)
        for reason in REFUSAL_REASONS:
            self.sessions_refused.labels(reason=reason)  # every reason shows, at 0, from the first scrape

    def watch(self, *, sessions_open: Callable[[], float], connections: Callable[[], float],
              kv_cells_used: Callable[[], float]) -> None:
        """Read the gauges from these functions at every scrape."""
        self.sessions_open.set_function(sessions_open)
        self.connections.set_function(connections)
        self.kv_cells_used.set_function(kv_cells_used)

    # duo.draft.drafter.DraftObserver
    def on_round(self, report: RoundReport) -> None:
        self.round_seconds.observe(report.seconds)
        self.sessions_per_round.observe(report.sessions)
        self.tokens_per_round.observe(report.tokens)
        self.draft_tokens.inc(report.drafted)
        self.pauses.inc(report.paused)
        self.guessed_tokens.inc(report.guessed)
        self.guessed_tokens_kept.inc(report.kept)

    def refused(self, reason: str) -> None:
        self.sessions_refused.labels(reason=reason).inc()
