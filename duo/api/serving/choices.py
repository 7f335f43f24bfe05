"""The choices of one request (OpenAI's `n`, llama-server's `n_cmpl`; n = 1 is a set of one): one completion per
choice, each speculated like any request, the prompt's cells decoded once and shared."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from duo.api.serving.generate import Completion, Completions, Piece
from duo.api.serving.request import CompletionRequest


class Choices:
    """The running choices of one request; aclose() closes them all (each frees its place and its sessions)."""

    def __init__(self, choices: Sequence[Choice]) -> None:
        self.choices = list(choices)

    @classmethod
    async def start(cls, completions: Completions, requests: Sequence[CompletionRequest]) -> Choices:
        """Start every choice (their places taken together, the request prepared once: Completions.start_choices).
        The first decodes the prompt; with more than one, the others start once it has given its first token: the
        prompt is then in its cells, which each of them adopts (duo.llama.context.Context.adopt_prefix) instead of
        decoding it again. QueueFull or a ClientError as Completions.start_choices raises them, with every choice
        started closed."""
        started = cls([Choice(completion) for completion in await completions.start_choices(requests)])
        if len(started.choices) == 1:  # a set of one: its first piece is read by its answer, as it comes
            return started
        try:
            await started.choices[0].read_head()
        except BaseException:
            await started.aclose()
            raise
        return started

    async def collect(self) -> list[list[Piece]]:
        """Every choice's pieces; where one fails, the others are stopped (and awaited) before the error goes on."""
        tasks = [asyncio.ensure_future(collect(choice)) for choice in self.choices]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        """Close every choice, whatever closing one of them raises."""
        errors = []
        for choice in self.choices:
            try:
                await choice.aclose()
            except Exception as error:  # noqa: BLE001 - the others must close all the same
                errors.append(error)
        if errors:
            raise errors[0]


class Choice:
    """A completion whose first piece may have been read already (to know its prompt is decoded)."""

    def __init__(self, completion: Completion) -> None:
        self.completion = completion
        self.head: Piece | None = None

    @property
    def prompt_tokens(self) -> int:
        """The prepared prompt's tokens: known before its first piece (Anthropic's message_start tells them)."""
        return self.completion.prompt_tokens

    async def read_head(self) -> None:
        self.head = await anext(aiter(self.completion), None)

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[Piece]:
        if self.head is not None:
            head, self.head = self.head, None
            yield head
        async for piece in self.completion:
            yield piece

    async def aclose(self) -> None:
        await self.completion.aclose()


def choice_requests(request: CompletionRequest, n: int) -> list[CompletionRequest]:
    """The request of each choice: a seed gives choice i the seed + i (each differs, all reproducible); a seed out
    of range is left for the check that refuses it."""
    if request.seed is None or not 0 <= request.seed < 2**64:
        return [request] * n
    return [replace(request, seed=(request.seed + i) % 2**64) for i in range(n)]


async def collect(completion: Completion | Choice) -> list[Piece]:
    """All the pieces of a completion (or a choice)."""
    return [piece async for piece in completion]


async def merge(streams: Sequence[AsyncIterator[str]]) -> AsyncIterator[tuple[int, str]]:
    """The items of all `streams` as each comes, with the index of its stream; closing this closes them all. A stream
    is read one item ahead at most: a client that reads slowly holds its choices' generations back as it would hold
    one (each item can be kilobytes: a token with 20 logprobs), instead of their text piling up here."""
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()  # at most one item and one end per stream
    room = [asyncio.Semaphore(1) for _ in streams]  # a stream's item waits until its last one was taken

    async def pump(i: int, stream: AsyncIterator[str]) -> None:
        try:
            async for item in stream:
                await room[i].acquire()
                queue.put_nowait((i, item))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            else:
                yield i, item
                room[i].release()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
