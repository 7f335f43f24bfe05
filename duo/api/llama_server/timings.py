"""llama-server's `timings` of an answer: its prompt's read and its decoding, counted and timed."""

from __future__ import annotations

import time

from duo.target.request import GenerationStats


def timings(stats: GenerationStats) -> dict[str, float | int]:
    """llama-server's timings: the prompt's part up to the first token (its queueing included), then decoding;
    draft_n is the drafts duo verified (llama-server counts those its draft made)."""
    ended = stats.finished_at or time.monotonic()
    prompt_s = (stats.first_token_at or ended) - stats.arrived
    predicted_s = ended - (stats.first_token_at or ended)
    prompt_n = stats.prompt_tokens - stats.cached_prompt_tokens
    predicted_n = max(stats.generated_tokens - 1, 0)  # the first token closes the prompt's part
    return {"cache_n": stats.cached_prompt_tokens, "prompt_n": prompt_n, "prompt_ms": 1000 * prompt_s,
            "prompt_per_token_ms": 1000 * prompt_s / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": stats.generated_tokens, "predicted_ms": 1000 * predicted_s,
            "predicted_per_token_ms": 1000 * predicted_s / predicted_n if predicted_n else 0.0,
            "predicted_per_second": predicted_n / predicted_s if predicted_s > 0 else 0.0,
            "draft_n": stats.draft_tokens_verified, "draft_n_accepted": stats.draft_tokens_accepted}
