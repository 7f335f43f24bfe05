"""llama-server's prompt_progress on a streamed answer."""

from __future__ import annotations

from typing import Any

from duo.api.output.timings import progress_timings
from duo.target.progress import ReadProgress


def prompt_progress(progress: ReadProgress) -> dict[str, int]:
    """How far the prompt's read got: its tokens (`total`), those found in the cache, those in its sequence now
    (`processed`, the cache's included) and the milliseconds since the read began."""
    return {"total": progress.total, "cache": progress.cache, "processed": progress.processed,
            "time_ms": int(1000 * progress.seconds)}


def progress_event(event: dict[str, Any], progress: ReadProgress, timings: bool) -> dict[str, Any]:
    """`event` (an event of no text in its endpoint's shape) carrying `progress`, and its timings where the
    request asked for them on every event (timings_per_token)."""
    event = {**event, "prompt_progress": prompt_progress(progress)}
    if timings:
        event["timings"] = progress_timings(progress)
    return event
