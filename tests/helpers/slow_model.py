"""A served model that takes its time: it reads its prompt for a while, then writes given pieces at a given pace (for
the streams' heartbeats: what a client sees while an agent's long prompt is read)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

from duo.api.serving.admit import Admission
from duo.api.serving.generate import Completion, Completions, Piece
from duo.api.serving.metrics import Metrics
from duo.api.serving.request import CompletionRequest
from duo.api.tools import HERMES, CallFormat
from duo.target.request import GenerationStats


class Released:
    """A completion's running place, as the scripted completions hold none."""

    def release(self) -> None:
        pass


class SlowCompletions(Completions):
    """Completions whose model reads its prompt for `prompt_s` seconds, then writes `pieces` one every `piece_s`
    seconds, in Hermes' call format."""

    def __init__(self, pieces: list[str], prompt_s: float, piece_s: float) -> None:
        super().__init__(Admission(1, 1), Metrics(), ["slow"])
        self.pieces, self.prompt_s, self.piece_s = pieces, prompt_s, piece_s

    def call_format(self) -> CallFormat | None:
        return HERMES

    async def start_choices(self, requests: Sequence[CompletionRequest]) -> list[Completion]:
        return [Completion(self._written(), Released())]

    async def _written(self) -> AsyncGenerator[Piece, None]:
        await asyncio.sleep(self.prompt_s)
        for i, text in enumerate(self.pieces):
            if i:
                await asyncio.sleep(self.piece_s)
            last = i == len(self.pieces) - 1
            yield Piece(text, [], "stop" if last else None, GenerationStats(prompt_tokens=5, generated_tokens=i + 1),
                        False)
