"""A draft's servicer driven by hand with fake streams: counting model, streams, what the draft holds."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from duo.draft.drafter import Drafter
from duo.draft.metrics import DraftMetrics
from duo.draft.service import DraftServicer, SessionLimits
from duo.llama.model import Model
from duo.llama.context import Context
from duo.llama.worker import ModelWorker
from duo.net._proto import duo_pb2 as pb


PROMPT = [9707, 11, 1879]


def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics page, named with its labels: {'name{label="value"}': value}."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


class CountingModel:
    """The draft model, counting the llama contexts made and closed through it and their batched decodes
    (the parts of each); each creation, close or decode first waits `delay` seconds (on the model
    thread), so that a test can cancel in the middle."""

    def __init__(self, model: Model, *, delay: float = 0.0) -> None:
        self._model = model
        self.delay = delay
        self.made = self.closed = 0
        self.calls: list[int] = []  # parts per decode_parts call
        self.creating, self.closing, self.decoding = threading.Event(), threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def new_context(self, n_ctx: int, **options: int) -> Context:
        self.creating.set()
        time.sleep(self.delay)
        context = self._model.new_context(n_ctx, **options)
        self.made += 1
        close, decode_parts = context.close, context.decode_parts

        def slow_close() -> None:
            self.closing.set()
            time.sleep(self.delay)
            close()
            self.closed += 1

        def slow_decode_parts(parts) -> list[np.ndarray]:
            self.decoding.set()
            time.sleep(self.delay)
            self.calls.append(len(parts))
            return decode_parts(parts)
        context.close, context.decode_parts = slow_close, slow_decode_parts
        return context

    async def wait_until_made(self, timeout: float = 5) -> None:
        deadline = time.monotonic() + timeout
        while not self.made and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


def slots_held(drafter: Drafter) -> int:
    return drafter.max_sessions - drafter.slots_free


async def holds_nothing(drafter: Drafter) -> bool:
    """Whether no session holds a slot or a cell, once the model thread ran what was queued on it
    (it runs its calls in order)."""
    await drafter.worker.run(time.sleep, 0)
    return slots_held(drafter) == 0 and drafter.cells_used == 0


class Peer:
    """The grpc.aio.ServicerContext that Speculate uses."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


class Stream:
    """A target's side of one Speculate stream: send TargetEvents, read DraftEvents."""

    def __init__(self, servicer: DraftServicer) -> None:
        self.requests: asyncio.Queue[pb.TargetEvent | None] = asyncio.Queue()
        self.events: list[pb.DraftEvent] = []
        self.task = asyncio.create_task(self._run(servicer))

    async def _requests(self):
        while (event := await self.requests.get()) is not None:
            yield event

    async def _run(self, servicer: DraftServicer) -> None:
        async for event in servicer.Speculate(self._requests(), Peer()):
            self.events.append(event)

    def open(self, session_id: int, committed: list[int] = PROMPT, **fields) -> None:
        fields = {"max_ahead": 4, **fields}
        self.requests.put_nowait(pb.TargetEvent(open=pb.OpenSession(session_id=session_id, committed=committed,
                                                                    **fields)))

    def send(self, **event) -> None:
        self.requests.put_nowait(pb.TargetEvent(**event))

    def errors(self) -> dict[int, str]:
        return {e.error.session_id: e.error.message for e in self.events if e.WhichOneof("event") == "error"}

    def chunks(self, session_id: int) -> list[pb.DraftChunk]:
        return [e.chunk for e in self.events if e.WhichOneof("event") == "chunk" and e.chunk.session_id == session_id]

    async def until(self, condition: Callable[[], bool], timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert not self.task.done(), "the stream ended"
            assert time.monotonic() < deadline, f"timed out; events so far: {self.events}"
            await asyncio.sleep(0.005)

    async def end(self) -> None:
        self.requests.put_nowait(None)
        await self.task


def servicer_for(model: Model, *, drafter_class: type[Drafter] = Drafter, n_ctx: int = 64, cells: int | None = None,
                 limits: SessionLimits = SessionLimits()) -> tuple[DraftServicer, DraftMetrics]:
    metrics = DraftMetrics()
    drafter = drafter_class(model, ModelWorker(), n_ctx=n_ctx, top_k_cap=10, observer=metrics,
                            max_sessions=limits.total, cells=cells)
    return DraftServicer(drafter, limits, metrics), metrics
