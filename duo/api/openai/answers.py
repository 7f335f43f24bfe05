"""What OpenAI's /v1/completions and /v1/chat/completions answer: a completion or chat completion whole, or as
server-sent chunks."""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from duo import __version__
from duo.api.openai.errors import api_error, generation_error
from duo.api.output.beats import kept_alive
from duo.api.output.deltas import (CallArguments, CallClosed, CallOpened, Delta, Reasoning, ReasoningDelta, TextDelta,
                                   answer_splitter, whole_answer)
from duo.api.output.logprobs import chat_logprobs, completion_logprobs
from duo.api.output.progress import progress_event
from duo.api.output.timings import timings
from duo.api.serving.choices import Choice
from duo.api.serving.decode import SourceAligner
from duo.api.serving.generate import Piece
from duo.api.serving.request import ShuttingDown
from duo.api.tools import CallFormat, FunctionBody

# A stream with nothing to send for this long (its prompt read, a call held until whole) sends an SSE comment, which
# every SSE parser skips: clients give up on a silent stream (opencode after 5 minutes without a chunk, then sends
# the turn again), and an agent's long prompt read on one CPU core, or a long file written in a call, outlasts that.
KEEP_ALIVE_S = 10.0
KEEP_ALIVE = ": keep-alive\n\n"
# Which build answered (OpenAI's system_fingerprint), in llama-server's shape b<build>-<name>: duo's version.
SYSTEM_FINGERPRINT = f"b{__version__}-duo"


def usage(piece: Piece) -> dict[str, Any]:
    prompt, completion = piece.stats.prompt_tokens, piece.stats.generated_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": piece.stats.cached_prompt_tokens}}


class OpenAIFormat(ABC):
    """How one endpoint shapes its answer: whole (a JSON object) or as server-sent event chunks."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, model: str, sources: bool = False, timings_per_token: bool = False,
                 verbose: Callable[[list[Piece]], dict[str, Any]] | None = None) -> None:
        self.model = model
        # llama-server's `verbose`: the whole answer carries its native one (NativeFormat.whole) as __verbose
        self.verbose = verbose
        self.timings_per_token = timings_per_token  # llama-server's: every chunk after the first carries timings
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        # The `duo_sources` extension: each chunk says where its text came from (duo.api.serving.decode), and which steps
        # committed the tokens since the chunk before (steps whose text is held back go with the next chunk).
        self.sources = SourceAligner() if sources else None
        self.unsent_steps: list[list[str]] = []
        self.shown = 0  # characters of text streamed so far

    def whole(self, pieces: list[Piece]) -> dict[str, Any]:
        last = pieces[-1]
        self.read(pieces[0])
        text = "".join(piece.text for piece in pieces)
        choice = self.whole_choice(text, last.finish_reason)
        if last.logprobs is not None:
            choice["logprobs"] = self.shown_logprobs([entry for piece in pieces for entry in piece.logprobs or []], 0)
        answer = {**self.envelope(self.object_name), "choices": [choice], "usage": usage(last),
                  "timings": timings(last.stats), "duo_stats": last.stats.fields(last.draft_connected)}
        if self.verbose is not None:
            answer["__verbose"] = self.verbose(pieces)
        return answer

    async def events(self, choice: Choice, include_usage: bool) -> AsyncIterator[str]:
        try:
            for chunk in self.opening_chunks():
                yield sse(self._chunk(chunk, include_usage))
            events = kept_alive(choice, KEEP_ALIVE_S, lambda piece: self._piece_events(piece, include_usage),
                                lambda: KEEP_ALIVE)
            async with aclosing(events):
                async for event in events:
                    yield event
        except ShuttingDown as error:
            yield sse(api_error(error).body())
        except Exception as error:  # this request's own failure: an error event, then [DONE] as always
            yield sse(generation_error(error).body())
        yield "data: [DONE]\n\n"

    def _piece_events(self, piece: Piece, include_usage: bool) -> list[str]:
        """The chunks a piece of the answer makes: none while its text is held back (a call being read)."""
        if piece.progress is not None:  # llama-server's return_progress: a chunk of no text says it
            return [sse(progress_event(self._chunk(self.progress_choice(), include_usage), piece.progress,
                                       self.timings_per_token))]
        self.read(piece)
        if self.sources is not None:
            self.sources.feed(piece.text, piece.sources)
            self.unsent_steps.append(list(piece.token_sources))
        choices = self.chunk_choices(piece.text, piece.finish_reason) if piece.text or piece.finish_reason else []
        if piece.logprobs is not None:
            choices = choices or [self.empty_choice(None)]
            choices[0]["logprobs"] = self.shown_logprobs(piece.logprobs, self.shown)
        self.shown += len(piece.text)
        events = []
        for choice in choices:
            chunk = self._chunk(choice, include_usage)
            if self.sources is not None:
                chunk["duo"] = self._sources(choice)
            if choice["finish_reason"]:
                chunk["duo_stats"] = piece.stats.fields(piece.draft_connected)
            # llama-server's: the last chunk carries the timings, and every one where timings_per_token
            if self.timings_per_token or (choice["finish_reason"] and not include_usage):
                chunk["timings"] = timings(piece.stats)
            events.append(sse(chunk))
        if piece.finish_reason and include_usage:
            events.append(sse({**self.envelope(self.chunk_object_name), "choices": [], "usage": usage(piece),
                               "timings": timings(piece.stats)}))
        return events

    def _chunk(self, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
        chunk = {**self.envelope(self.chunk_object_name), "choices": [choice]}
        if include_usage:
            chunk["usage"] = None  # as OpenAI: only the extra last chunk carries usage
        return chunk

    def _sources(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A chunk's `duo` object: its text's runs of one source, and the steps not told before."""
        steps, self.unsent_steps = self.unsent_steps, []
        return {"sources": self.sources.runs(self.shown_text(choice)), "steps": steps}

    def envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def read(self, piece: Piece) -> None:
        """Take what a piece says of the whole answer (how its reasoning reads), before its text."""

    def progress_choice(self) -> dict[str, Any]:
        """The choice of a chunk that tells the prompt's read (prompt_progress) and nothing else."""
        return self.empty_choice(None)

    @abstractmethod
    def shown_logprobs(self, entries: list[dict[str, Any]], offset: int) -> Any:
        """Tokens' logprobs (duo.api.output.logprobs.described) in this answer's shape; `offset`: text sent before them."""

    @abstractmethod
    def whole_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]: ...

    @abstractmethod
    def chunk_choices(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        """The chunks' choices for a piece's text (none while it is held back); the last carries the finish."""

    @abstractmethod
    def empty_choice(self, finish_reason: str | None) -> dict[str, Any]: ...

    @abstractmethod
    def shown_text(self, choice: dict[str, Any]) -> str:
        """The text a chunk's choice shows of the model's (its sources' runs concatenate to it)."""


class CompletionFormat(OpenAIFormat):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def whole_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choices(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        return [self.whole_choice(text, finish_reason)]

    def empty_choice(self, finish_reason: str | None) -> dict[str, Any]:
        return self.whole_choice("", finish_reason)

    def shown_text(self, choice: dict[str, Any]) -> str:
        return choice["text"]

    def shown_logprobs(self, entries: list[dict[str, Any]], offset: int) -> Any:
        return completion_logprobs(entries, offset)


class ChatFormat(OpenAIFormat):
    """Chat answers, split into content, reasoning_content and tool_calls (duo.api.output.deltas): whole, or streamed as
    llama-server streams them, each chunk's delta one of content, reasoning_content or one call's entry (its id and
    name first, then pieces of its arguments); finish_reason "tool_calls" where the model called any (`called`)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model: str, functions: list[FunctionBody] | None = None,
                 format_: CallFormat | None = None, sources: bool = False, timings_per_token: bool = False,
                 verbose: Callable[[list[Piece]], dict[str, Any]] | None = None, post_sampling: bool = False) -> None:
        super().__init__(model, sources, timings_per_token, verbose)
        self.post_sampling = post_sampling  # llama-server's post_sampling_probs: probabilities after the chain
        self.functions, self.format = functions, format_
        self.reasoning = Reasoning()
        self.splitter = None
        self.calls = 0

    def opening_chunks(self) -> list[dict[str, Any]]:
        # content null, as llama-server and OpenAI open a stream: no text yet
        return [{"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}]

    def read(self, piece: Piece) -> None:
        self.reasoning = piece.reasoning

    def progress_choice(self) -> dict[str, Any]:
        return self.opening_chunks()[0]  # as llama-server: the assistant's role, no content yet

    def shown_logprobs(self, entries: list[dict[str, Any]], offset: int) -> Any:
        return chat_logprobs(entries, self.post_sampling)

    def whole_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        deltas = whole_answer(text, self.functions, self.format, self.reasoning)
        calls = [delta.call.message() for delta in deltas if isinstance(delta, CallClosed)]
        content = "".join(delta.text for delta in deltas if isinstance(delta, TextDelta))
        reasoning = "".join(delta.text for delta in deltas if isinstance(delta, ReasoningDelta))
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return {"index": 0, "message": message, "logprobs": None,
                "finish_reason": called(finish_reason, bool(calls))}

    def chunk_choices(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        if self.splitter is None:
            self.splitter = answer_splitter(self.functions, self.format, reasoning=self.reasoning)
        deltas = self.splitter.feed(text) + (self.splitter.finish() if finish_reason else [])
        choices = [self._choice(delta) for delta in _joined(deltas) if not isinstance(delta, CallClosed)]
        if finish_reason:  # a chunk of its own, its delta empty, as llama-server ends a chat stream
            choices.append(self.empty_choice(called(finish_reason, bool(self.calls))))
        return choices

    def empty_choice(self, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}

    def shown_text(self, choice: dict[str, Any]) -> str:
        """The delta's one text: its content, its reasoning, or a piece of a call's arguments."""
        delta = choice["delta"]
        calls = delta.get("tool_calls")
        return delta.get("content") or delta.get("reasoning_content") or (calls[0]["function"]["arguments"]
                                                                           if calls else "")

    def _choice(self, delta: Delta) -> dict[str, Any]:
        """One delta's chunk: clients that read one tool call a delta (LlamaIndex), or drop the calls of a delta
        that has content (Continue), get every call."""
        if isinstance(delta, TextDelta):
            shown: dict[str, Any] = {"content": delta.text}
        elif isinstance(delta, ReasoningDelta):
            shown = {"reasoning_content": delta.text}
        elif isinstance(delta, CallOpened):
            self.calls += 1
            shown = {"tool_calls": [{"index": delta.index, "id": delta.id, "type": "function",
                                     "function": {"name": delta.name, "arguments": ""}}]}
        else:
            assert isinstance(delta, CallArguments)
            shown = {"tool_calls": [{"index": delta.index, "function": {"arguments": delta.text}}]}
        return {**self.empty_choice(None), "delta": shown}


def called(finish_reason: str | None, calls: bool) -> str | None:
    """The finish of an answer with `calls` or none: "tool_calls" where it called and ended on its own, as
    llama-server says; an answer cut by max_tokens is "length" whatever it wrote, its last call perhaps unfinished."""
    return "tool_calls" if calls and finish_reason and finish_reason != "length" else finish_reason


def _joined(deltas: list[Delta]) -> list[Delta]:
    """`deltas` with neighbouring text of one kind (or pieces of one call's arguments) as one."""
    joined: list[Delta] = []
    for delta in deltas:
        last = joined[-1] if joined else None
        if isinstance(delta, (TextDelta, ReasoningDelta)) and type(last) is type(delta):
            joined[-1] = type(delta)(last.text + delta.text)
        elif isinstance(delta, CallArguments) and isinstance(last, CallArguments) and last.index == delta.index:
            joined[-1] = CallArguments(delta.index, last.text + delta.text)
        else:
            joined.append(delta)
    return joined


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
