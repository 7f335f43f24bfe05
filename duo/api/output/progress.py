"""llama-server's prompt_progress on a streamed answer, and the timings a progress event carries."""

from __future__ import annotations

from typing import Any

from duo.target.progress import ReadProgress


def prompt_progress(progress: ReadProgress) -> dict[str, int]:
    """How far the prompt's read got: its tokens (`total`), those found in the cache, those in its sequence now
    (`processed`, the cache's included) and the milliseconds since the read began."""
    return {"total": progress.total, "cache": progress.cache, "processed": progress.processed,
            "time_ms": int(1000 * progress.seconds)}


def progress_timings(progress: ReadProgress) -> dict[str, Any]:
    """The timings of a progress event (timings_per_token), as llama-server's at that point: the prompt's part so
    far (0 before its first read), nothing predicted yet; the names of duo.api.llama_server.timings."""
    prompt_ms, prompt_n = 1000 * progress.read_seconds, progress.read
    return {"cache_n": progress.cache, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": 0, "predicted_ms": 0.0, "predicted_per_token_ms": 0.0, "predicted_per_second": 0.0,
            "draft_n": 0, "draft_n_accepted": 0}


def progress_event(event: dict[str, Any], progress: ReadProgress, timings: bool) -> dict[str, Any]:
    """`event` (an event of no text in its endpoint's shape) carrying `progress`, and its timings where the
    request asked for them on every event (timings_per_token)."""
    event = {**event, "prompt_progress": prompt_progress(progress)}
    if timings:
        event["timings"] = progress_timings(progress)
    return event
