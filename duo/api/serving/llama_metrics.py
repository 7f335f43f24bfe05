"""llama-server's Prometheus metrics (llamacpp:*, its names, help lines and meanings), counted beside duo's own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from duo.target.request import GenerationStats, StepRecord


@dataclass
class Bucket:
    """Tokens and the seconds they took; `steps` leaves out the first generated token, which comes with the prompt's
    last batch and costs no decode (llama-server's rate counts decode steps, as duo's timings do)."""

    count: int = 0
    steps: int = 0
    seconds: float = 0.0

    def add(self, count: int, steps: int, seconds: float) -> None:
        self.count += count
        self.steps += steps
        self.seconds += seconds

    def per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0


class LlamaCppMetrics:
    """The counters and gauges llama-server's /metrics shows, from the same events as duo's (target steps, model
    calls, finished requests). The rates (llamacpp:*_tokens_seconds) are over the window since the last scrape, as
    llama-server's: each render starts a new one. A *draft* here is a verify step that checked draft tokens; the draft
    tokens are those the target verified (the ones it saw)."""

    def __init__(self) -> None:
        self.prompt, self.predict = Bucket(), Bucket()  # since the start
        self.prompt_window, self.predict_window = Bucket(), Bucket()  # since the last scrape
        self.prompt_cached = 0
        self.tokens_max = 0
        self.decodes = 0
        self.busy_slots = 0  # requests summed over every model call
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.drafts = 0
        self.accepted_per_pos: list[int] = []
        self.running: Callable[[], float] = lambda: 0.0
        self.waiting: Callable[[], float] = lambda: 0.0

    def on_step(self, record: StepRecord) -> None:
        if record.n_verified == 0:
            return
        self.drafts += 1
        self.draft_tokens += record.n_verified
        self.accepted_tokens += record.n_accepted
        if len(self.accepted_per_pos) < record.n_accepted:
            self.accepted_per_pos.extend([0] * (record.n_accepted - len(self.accepted_per_pos)))
        for position in range(record.n_accepted):
            self.accepted_per_pos[position] += 1

    def on_call(self, requests: int) -> None:
        self.decodes += 1
        self.busy_slots += requests

    def request_finished(self, stats: GenerationStats) -> None:
        """Count what one request read and generated: the prompt up to its first token, the rest as generation."""
        ended = stats.finished_at or stats.first_token_at or stats.started
        first = stats.first_token_at or ended
        processed = stats.prompt_tokens - stats.cached_prompt_tokens
        steps = max(stats.generated_tokens - 1, 0)
        for bucket in (self.prompt, self.prompt_window):
            bucket.add(processed, processed, max(first - stats.started, 0.0))
        for bucket in (self.predict, self.predict_window):
            bucket.add(stats.generated_tokens, steps, max(ended - first, 0.0))
        self.prompt_cached += stats.cached_prompt_tokens
        self.tokens_max = max(self.tokens_max, stats.prompt_tokens + stats.generated_tokens)

    def render(self) -> str:
        """llama-server's text: HELP, TYPE and value of each counter, then each gauge, then the accepted tokens per
        draft position; the window of the rates starts again."""
        counters = [
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", self.prompt.count),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", self.prompt_cached),
            ("prompt_seconds_total", "Total time spent processing prompts", self.prompt.seconds),
            ("tokens_predicted_total", "Number of generation tokens processed", self.predict.count),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", self.predict.seconds),
            ("n_decode_total", "Total number of model calls (llama_decode), prompt chunks and verify batches",
             self.decodes),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", self.tokens_max),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens verified", self.draft_tokens),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
             self.accepted_tokens),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
             self.drafts),
        ]
        gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", self.prompt_window.per_second()),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
             self.predict_window.per_second()),
            ("requests_processing", "Number of requests processing", self.running()),
            ("requests_deferred", "Number of requests deferred", self.waiting()),
            ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
             self.busy_slots / max(self.decodes, 1)),
        ]
        lines = [line for kind, items in (("counter", counters), ("gauge", gauges))
                 for name, help_text, value in items
                 for line in (f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                              f"llamacpp:{name} {_number(value)}")]
        if self.accepted_per_pos:
            name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
            lines += [f"# HELP {name} Accepted tokens per draft position", f"# TYPE {name} counter"]
            lines += [f'{name}{{position="{position}"}} {count}' for position, count in enumerate(self.accepted_per_pos)]
        self.prompt_window, self.predict_window = Bucket(), Bucket()
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """A count as an integer, a time or a rate as Python writes a float (exact, where llama-server rounds to 6
    digits)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
