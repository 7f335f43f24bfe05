"""llama-server's `timings` of an answer (its prompt's read and its decoding, counted and timed), on every protocol's
answer, and the timings so far that a prompt_progress event carries."""

from __future__ import annotations

import time

from duo.target.progress import ReadProgress
from duo.target.request import GenerationStats


def timings(stats: GenerationStats) -> dict[str, float | int]:
    """llama-server's timings: the prompt's part up to the first token (its queueing included), then decoding;
    draft_n is the drafts duo verified (llama-server counts those its draft made)."""
    ended = stats.finished_at or time.monotonic()
    prompt_s = (stats.first_token_at or ended) - stats.arrived
    predicted_s = ended - (stats.first_token_at or ended)
    # predicted_n counts every token; the rates, those after the first (which closes the prompt's part)
    return _timings(stats.cached_prompt_tokens, stats.prompt_tokens - stats.cached_prompt_tokens, prompt_s,
                    stats.generated_tokens, max(stats.generated_tokens - 1, 0), predicted_s,
                    stats.draft_tokens_verified, stats.draft_tokens_accepted)


def progress_timings(progress: ReadProgress) -> dict[str, float | int]:
    """The timings of a progress event (timings_per_token), as llama-server's at that point: the prompt's part so
    far (0 before its first read), nothing predicted yet."""
    return _timings(progress.cache, progress.read, progress.read_seconds, 0, 0, 0.0, 0, 0)


def _timings(cache_n: int, prompt_n: int, prompt_s: float, predicted_n: int, timed_n: int, predicted_s: float,
             draft_n: int, draft_n_accepted: int) -> dict[str, float | int]:
    """llama-server's timing fields: counts, milliseconds and rates (0 where nothing was timed); `timed_n` of the
    `predicted_n` tokens took `predicted_s`."""
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": 1000 * prompt_s,
            "prompt_per_token_ms": 1000 * prompt_s / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": 1000 * predicted_s,
            "predicted_per_token_ms": 1000 * predicted_s / timed_n if timed_n else 0.0,
            "predicted_per_second": timed_n / predicted_s if predicted_s > 0 else 0.0,
            "draft_n": draft_n, "draft_n_accepted": draft_n_accepted}
