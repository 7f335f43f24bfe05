"""The model thread: model calls run one at a time on a thread of their own, so that the event loop serves meanwhile."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol, TypeVar

from duo.llama.errors import ModelError

T = TypeVar("T")
R = TypeVar("R", bound="Closeable")

log = logging.getLogger("duo.model")


class Closeable(Protocol):
    """A native resource, such as a llama context."""

    def close(self) -> None: ...


class ModelWorker:
    """Runs model calls one at a time on a dedicated thread, so the event loop keeps serving while a
    model computes (llama.cpp releases the GIL inside decode)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._waiting: set[asyncio.Future[Any]] = set()
        self.broken: str | None = None  # why the model can no longer run, once it cannot

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.broken:
            raise ModelError(self.broken)
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        self._waiting.add(future)
        try:
            return await future
        finally:
            self._waiting.discard(future)

    def break_down(self, message: str) -> None:
        """The model can run no more (llama.cpp lost an RPC server and is about to abort the process):
        fail the calls waiting for it, whose thread never returns, and every later call with `message`."""
        self.broken = message
        for future in self._waiting:
            if not future.done():
                future.set_exception(ModelError(message))

    async def create(self, factory: Callable[..., R], *args: Any) -> R:
        """`factory(*args)` on the model thread. A caller cancelled meanwhile never sees the result, so
        it is closed as soon as it is made (a native resource would otherwise live as long as its model)."""
        if self.broken:
            raise ModelError(self.broken)
        made: Future[R] = self._executor.submit(factory, *args)
        try:
            return await asyncio.shield(asyncio.wrap_future(made))
        except asyncio.CancelledError:
            if not made.cancel():  # already running (or done): it will exist
                made.add_done_callback(self._close_orphan)
            raise

    async def close(self, resource: Closeable) -> None:
        """`resource.close()` on the model thread; it runs to the end even if the caller is cancelled
        (a cancelled call still waiting its turn on the thread would otherwise never run). Once the model
        is broken its thread never returns: nothing is closed, the process is ending."""
        if self.broken:
            return
        await asyncio.shield(asyncio.get_running_loop().run_in_executor(self._executor, resource.close))

    def _close_orphan(self, made: Future[Closeable]) -> None:
        if made.exception() is None:
            closing = self._executor.submit(made.result().close)
            closing.add_done_callback(_log_close_failure)


def _log_close_failure(closing: Future[None]) -> None:
    if closing.exception() is not None:
        log.error("closing a resource nobody waited for failed", exc_info=closing.exception())


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """fn(*args) and the seconds it took; run it on the model thread (ModelWorker.run(timed, fn, ...))
    so that the wait behind other model calls is not counted."""
    began = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - began
