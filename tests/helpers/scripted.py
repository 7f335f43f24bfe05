"""Scripted stand-ins for a model, a target and a draft: tests of the serving layers without llama.cpp."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from duo.api.serving.admit import Admission
from duo.api.serving.generate import Completions
from duo.api.serving.metrics import Metrics
from duo.net.wire import ChainChunk
from duo.target.generation import Generation
from duo.target.request import GenerationStats, Request, Step
from helpers.fake_drafts import RecordingDraft


# Token id -> bytes; 1 and 2 split the UTF-8 bytes of "日" (e6 97 a5) between them.
PIECES = {1: b"\xe6\x97", 2: b"\xa5", 3: b" the", 4: b" end", 5: b".", 6: b"\n"}


class ScriptedModel:
    n_vocab = 10

    def tokenize(self, text: str) -> list[int]:
        return [3] * len(text.split())

    def vocab(self) -> SimpleNamespace:
        return SimpleNamespace(token_texts=tuple(PIECES.values()))

    def detokenize(self, tokens: list[int], *, special: bool = False) -> bytes:
        # Ids without a scripted piece (a prompt's own ids, up to n_vocab) read as nothing; none is special.
        return b"".join(PIECES.get(t, b"") for t in tokens)


@dataclass
class ScriptedTarget:
    """Commits the scripted steps; records whether its generation was closed (its session freed)."""

    steps: list[list[int]]
    model: ScriptedModel = field(default_factory=ScriptedModel)
    pool: None = None
    closed: int = 0
    generated: int = 0

    async def generate(self, request: Request, stats: GenerationStats | None = None, progress: bool = False):
        stats = stats if stats is not None else GenerationStats(prompt_tokens=len(request.prompt_tokens))
        try:
            for i, tokens in enumerate(self.steps):
                stats.generated_tokens += len(tokens)
                self.generated += len(tokens)
                yield Step(tokens, "length" if i == len(self.steps) - 1 else None), stats
        finally:
            self.closed += 1


class ScriptedDraft(RecordingDraft):
    """A connected draft link that answers the session's opening and every commit with `chain(committed)` at
    once: the right answer, or whatever a broken or hostile draft would send."""

    def __init__(self, chain) -> None:
        super().__init__()
        self.chain = chain
        self.generation: Generation | None = None
        self.epoch = 0

    def register(self, generation: Generation) -> None:
        self.generation = generation
        generation.open_message()
        self._send()

    def unregister(self, session_id: int) -> None:
        pass

    def send(self, event) -> None:
        if event.HasField("commit"):
            self._send()

    def _send(self) -> None:
        generation = self.generation
        tokens = self.chain(list(generation.committed))
        if tokens:
            self.epoch += 1  # a new chain from each commit, as a draft whose chain the commit ran past
            generation.on_chunk(ChainChunk(epoch=self.epoch, start=len(generation.committed), tokens=tokens,
                                           dists=[]))


def scripted(parallel: int = 1, queue_size: int = 0) -> Completions:
    service = Completions(Admission(parallel, queue_size), Metrics(), ["scripted"])
    service.ready(ScriptedTarget([[3], [4]]), context_size=100)  # type: ignore[arg-type]
    return service
