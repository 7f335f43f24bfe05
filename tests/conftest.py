"""Shared pytest fixtures.

The model fixtures are tiny random-weight GGUF files with the real Qwen2.5
tokenizer (see ``tests/tiny_models.py``), written once per test session.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiny_models import (
    MISMATCH_TOKEN_ID,
    MISMATCH_TOKEN_TEXT,
    OVERSIZED_EXTRA_TOKENS,
    write_tiny_model,
    write_tiny_pair,
)


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_pair(tiny_models_dir: Path) -> tuple[Path, Path]:
    """(target, draft): the draft is the target's weights plus noise."""
    return write_tiny_pair(tiny_models_dir)


@pytest.fixture(scope="session")
def tiny_target(tiny_pair: tuple[Path, Path]) -> Path:
    return tiny_pair[0]


@pytest.fixture(scope="session")
def tiny_draft(tiny_pair: tuple[Path, Path]) -> Path:
    return tiny_pair[1]


@pytest.fixture(scope="session")
def tiny_mismatched(tiny_models_dir: Path, tiny_draft: Path) -> Path:
    """``tiny_draft`` whose vocabulary text differs from the target's at ``MISMATCH_TOKEN_ID``."""
    return write_tiny_model(
        tiny_models_dir / "tiny-mismatched.gguf",
        seed=0,
        base=tiny_draft,
        tokenizer_edits={MISMATCH_TOKEN_ID: MISMATCH_TOKEN_TEXT},
    )


@pytest.fixture(scope="session")
def tiny_oversized(tiny_models_dir: Path, tiny_draft: Path) -> Path:
    """``tiny_draft`` with ``OVERSIZED_EXTRA_TOKENS`` unused tokens appended to the vocabulary."""
    return write_tiny_model(
        tiny_models_dir / "tiny-oversized.gguf",
        seed=0,
        base=tiny_draft,
        extra_tokens=OVERSIZED_EXTRA_TOKENS,
    )
