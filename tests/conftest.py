"""Shared pytest fixtures, and the `processes` marker on every test that starts real processes.

The model fixtures are tiny random-weight GGUF files with the real Qwen2.5
tokenizer (see ``tests/helpers/tiny_models.py``), written once per test session.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers.tiny_models import (
    DRAFT_NOISE,
    DRAFT_SEED,
    MISMATCH_TOKEN_ID,
    MISMATCH_TOKEN_TEXT,
    OVERSIZED_EXTRA_TOKENS,
    TARGET_SEED,
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
def long_tiny_pair(tiny_models_dir: Path) -> tuple[Path, Path]:
    """(target, draft) with a 32k context (f32 embeddings): room for the coding agents' 9k-19k-token prompts."""
    target = write_tiny_model(tiny_models_dir / "long-target.gguf", seed=TARGET_SEED, embedding_type="f32",
                              n_ctx=32768)
    draft = write_tiny_model(tiny_models_dir / "long-draft.gguf", seed=DRAFT_SEED, base=target, noise=DRAFT_NOISE)
    return target, draft


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


# duo-target processes shared by the client-endpoint tests (tests/api/test_http_api.py, tests/api/test_grpc_api.py).
# CONTEXT_SIZE is small so that a prompt longer than the context is cheap to send.
CONTEXT_SIZE = 512


@pytest.fixture(scope="session")
def target_model(tiny_target: Path):
    """The tiny target loaded in this process (one core), for tests of the model layer and the loops."""
    from duo.llama.model import Model

    model = Model(tiny_target, device="cpu", threads=1)
    yield model
    model.close()


@pytest.fixture(scope="session")
def draft_model(tiny_draft: Path):
    """The tiny draft loaded in this process (one core)."""
    from duo.llama.model import Model

    model = Model(tiny_draft, device="cpu", threads=1)
    yield model
    model.close()


@pytest.fixture(scope="session")
def process_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("process-logs")


@pytest.fixture(scope="session")
def served_alone(tiny_target: Path, process_logs: Path):
    """duo-target without a draft, serving gRPC and HTTP."""
    from helpers.processes import start

    process = start("duo.cli.target", ["--model", str(tiny_target), "--ctx-size", str(CONTEXT_SIZE)], process_logs,
                    http=True)
    yield process
    process.stop()


@pytest.fixture(scope="session")
def served_draft(tiny_draft: Path, process_logs: Path):
    from helpers.processes import start

    process = start("duo.cli.draft", ["--model", str(tiny_draft)], process_logs)
    yield process
    process.stop()


@pytest.fixture(scope="session")
def served_duo(tiny_target: Path, served_draft, process_logs: Path):
    """duo-target speculating with a draft, serving gRPC and HTTP; the draft is connected.

    Speculation is fixed (--draft-max) so that every generation verifies draft tokens, whatever the
    adaptive policy would conclude about the tiny model's costs on this CPU.
    """
    from helpers.processes import start, wait_for_draft

    process = start("duo.cli.target", ["--model", str(tiny_target), "--peer", served_draft.address, "--draft-max", "4"],
                    process_logs, http=True)
    wait_for_draft(process.address)
    yield process
    process.stop()


@pytest.fixture(scope="session")
def served_sync(tiny_target: Path, served_draft, process_logs: Path):
    """duo-target in the synchronous mode (--sync 4) beside the same draft: each step waits for the
    draft's tokens, so every generation verifies some whatever the machine's load. Tests that must
    see the draft take part use it (the adaptive and --draft-max targets never wait for a tiny draft
    that is no faster than its tiny target)."""
    from helpers.processes import start, wait_for_draft

    process = start("duo.cli.target", ["--model", str(tiny_target), "--peer", served_draft.address, "--sync", "4"],
                    process_logs, http=True)
    wait_for_draft(process.address)
    yield process
    process.stop()


# The fixtures above that start duo-draft / duo-target processes.
PROCESS_FIXTURES = frozenset({"served_alone", "served_draft", "served_duo", "served_sync"})


def starts_processes(module) -> bool:
    """Whether a test module starts processes itself: it holds helpers.processes' start or the subprocess module."""
    from helpers import processes

    names = vars(module).values()
    return any(value is processes.start or value is subprocess for value in names)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `processes` the tests that start processes, so that `pytest -m "not processes"` is the fast run."""
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())) or starts_processes(item.module):
            item.add_marker(pytest.mark.processes)
