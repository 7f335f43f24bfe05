"""llama-server's Prometheus metrics (llamacpp:*, its names, help lines and meanings), counted beside duo's own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from duo.target.request import GenerationStats


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
    """The counters and gauges llama-server's /metrics shows. What duo's own metrics count already (speculation,
    model calls, cached prompt tokens) is read from duo's `registry` at each scrape; the rest is counted here from the
    finished requests. The rates (llamacpp:*_tokens_seconds) are over the window since the last scrape, as
    llama-server's: each render starts a new one. A *draft* here is a verify step that checked draft tokens; the draft
    tokens are those the target verified (the ones it saw)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.prompt, self.predict = Bucket(), Bucket()  # since the start
        self.prompt_window, self.predict_window = Bucket(), Bucket()  # since the last scrape
        self.tokens_max = 0
        self.running: Callable[[], float] = lambda: 0.0
        self.waiting: Callable[[], float] = lambda: 0.0

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
        self.tokens_max = max(self.tokens_max, stats.prompt_tokens + stats.generated_tokens)

    def render(self) -> str:
        """llama-server's text: HELP, TYPE and value of each counter, then each gauge, then the accepted tokens per
        draft position; the window of the rates starts again."""
        duo = {(sample.name, tuple(sample.labels.items())): sample.value  # one read of duo's metrics
               for family in self.registry.collect() for sample in family.samples}

        def counted(name: str) -> float:
            return duo.get((name, ()), 0.0)

        decodes, busy_slots = counted("duo:iteration_requests_count"), counted("duo:iteration_requests_sum")
        per_pos = "duo:spec_decode_num_accepted_tokens_per_pos_total"
        accepted_per_pos = sorted((int(labels[0][1]), value) for (name, labels), value in duo.items()
                                  if name == per_pos)
        counters = [
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", self.prompt.count),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
             counted("duo:prompt_tokens_cached_total")),
            ("prompt_seconds_total", "Total time spent processing prompts", self.prompt.seconds),
            ("tokens_predicted_total", "Number of generation tokens processed", self.predict.count),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", self.predict.seconds),
            ("n_decode_total", "Total number of model calls (llama_decode), prompt chunks and verify batches",
             decodes),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", self.tokens_max),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens verified",
             counted("duo:spec_decode_num_draft_tokens_total")),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
             counted("duo:spec_decode_num_accepted_tokens_total")),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
             counted("duo:spec_decode_num_drafts_total")),
        ]
        gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", self.prompt_window.per_second()),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
             self.predict_window.per_second()),
            ("requests_processing", "Number of requests processing", self.running()),
            ("requests_deferred", "Number of requests deferred", self.waiting()),
            ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
             busy_slots / max(decodes, 1)),
        ]
        lines = [line for kind, items in (("counter", counters), ("gauge", gauges))
                 for name, help_text, value in items
                 for line in (f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                              f"llamacpp:{name} {_number(value)}")]
        if accepted_per_pos:
            name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
            lines += [f"# HELP {name} Accepted tokens per draft position", f"# TYPE {name} counter"]
            lines += [f'{name}{{position="{position}"}} {_number(count)}' for position, count in accepted_per_pos]
        self.prompt_window, self.predict_window = Bucket(), Bucket()
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """A count as an integer, a time or a rate as Python writes a float (exact, where llama-server rounds to 6
    digits)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
