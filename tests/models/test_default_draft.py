"""The draft a user gets without naming one is the fastest for its device: the Q4_0 copy on a CPU (made from the
published draft on first use, never downloaded behind the user's back), the published Q4_K_M on a GPU."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from duo.cli import draft as draft_process
from duo.models import hub
from duo.models.catalog import CATALOG, CPU_DRAFT, DEFAULT_DRAFT, default_draft


def test_a_cpu_gets_the_q4_0_copy_of_the_published_draft_and_a_gpu_the_published_one():
    name, why = default_draft(on_gpu=False)
    assert name == CPU_DRAFT and "CPU" in why
    assert CATALOG[name].derived_from == DEFAULT_DRAFT and CATALOG[name].ftype == "MOSTLY_Q4_0"
    assert CATALOG[name].role == "draft" and CATALOG[name].fim == CATALOG[DEFAULT_DRAFT].fim
    name, why = default_draft(on_gpu=True)
    assert name == DEFAULT_DRAFT and "GPU" in why


class FakeHub:
    """Which catalog models are present, and what was pulled (the Q4_0 copy made from its source)."""

    def __init__(self, present: set[str]) -> None:
        self.present = set(present)
        self.pulled: list[list[str]] = []

    def is_present(self, name: str) -> bool:
        return name in self.present

    def pull(self, names: list[str], progress: bool = True) -> list[Path]:
        self.pulled.append(list(names))
        self.present.update(names)
        return [Path(f"/models/{name}.gguf") for name in names]

    def resolve_model(self, name: str) -> Path:
        if name not in self.present and not Path(name).is_absolute():
            raise hub.ModelNotPulledError(f"model {name!r} is not pulled yet: run `duo models pull {name}`")
        return Path(name if Path(name).is_absolute() else f"/models/{name}.gguf")


@pytest.fixture
def fake_hub(monkeypatch) -> FakeHub:
    fake = FakeHub({DEFAULT_DRAFT})
    for name in ("is_present", "pull", "resolve_model"):
        monkeypatch.setattr(draft_process, name, getattr(fake, name))
    return fake


def args(device: str, model: str | None = None, gpu_layers: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(model=model, device=device, gpu_layers=gpu_layers)


def test_duo_draft_on_a_cpu_makes_the_q4_0_copy_once_and_says_why(fake_hub, caplog):
    with caplog.at_level(logging.INFO, logger="duo.draft"):
        assert draft_process.draft_model(args("cpu")) == Path(f"/models/{CPU_DRAFT}.gguf")
        assert draft_process.draft_model(args("cpu")) == Path(f"/models/{CPU_DRAFT}.gguf")
    assert fake_hub.pulled == [[CPU_DRAFT]]  # made from the present draft once, then found
    assert f"drafting with {CPU_DRAFT}.gguf: on a CPU" in caplog.text


def test_duo_draft_on_a_gpu_takes_the_published_draft(fake_hub, monkeypatch):
    monkeypatch.setattr(draft_process, "gpu_layers_for", lambda device, layers: -1)  # a GPU takes every layer
    assert draft_process.draft_model(args("auto")) == Path(f"/models/{DEFAULT_DRAFT}.gguf")
    monkeypatch.setattr(draft_process, "gpu_layers_for", lambda device, layers: 0)  # --gpu-layers 0: the CPU's
    assert draft_process.draft_model(args("auto", gpu_layers=0)) == Path(f"/models/{CPU_DRAFT}.gguf")


def test_a_named_draft_is_used_as_named_and_nothing_is_downloaded(fake_hub):
    fake_hub.present.clear()
    assert draft_process.draft_model(args("cpu", model="/elsewhere/my-draft.gguf")) == Path("/elsewhere/my-draft.gguf")
    with pytest.raises(hub.ModelNotPulledError, match=f"duo models pull {CPU_DRAFT}"):
        draft_process.draft_model(args("cpu"))  # neither the copy nor its source here: the user is told to pull
    assert fake_hub.pulled == []
