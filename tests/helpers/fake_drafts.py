"""A draft connection for tests that drive the target by hand: up from the start, it records what the target
sends it and sends nothing back (tests feed chunks to sessions themselves)."""

from __future__ import annotations

from duo.net._proto import duo_pb2 as pb
from duo.target.pool.connection import DraftConnection
from duo.llama.vocab import Vocab


class RecordingDraft(DraftConnection):
    def __init__(self, address: str = "recording-draft", vocab: Vocab | None = None) -> None:
        super().__init__(address, vocab, max_lead=16)  # type: ignore[arg-type]  (no chunk is checked here)
        self.state = "connected"
        self.events: list[pb.TargetEvent] = []

    def send(self, event: pb.TargetEvent) -> None:
        self.events.append(event)
