"""The tiny stand-in models of the suite's small ones, made as the project's tests make theirs (no download)."""

from __future__ import annotations

import sys
from pathlib import Path


def write_models(directory: Path, repository: Path) -> None:
    """The tiny stand-ins, made as the project's tests make theirs (tests/helpers/tiny_models.py), with a context
    long enough for the suite's -c 8192 and a Q8_0 embedding (fast: a server starts for every test)."""
    sys.path.insert(0, str(repository / "tests"))
    from helpers.tiny_models import DRAFT_NOISE, DRAFT_SEED, TARGET_SEED, write_tiny_model

    target = write_tiny_model(directory / "tiny.gguf", seed=TARGET_SEED, n_ctx=16384)
    write_tiny_model(directory / "tiny-draft.gguf", seed=DRAFT_SEED, base=target, noise=DRAFT_NOISE)
