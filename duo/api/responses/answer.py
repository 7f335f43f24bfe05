"""What POST /v1/responses answers: a response object whole, or the server-sent events that build it."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any

from duo.api.openai.errors import ApiError, api_error, generation_error
from duo.api.output.beats import kept_alive
from duo.api.output.deltas import AnswerSplitter, answer_splitter, whole_answer
from duo.api.output.progress import progress_event
from duo.api.output.timings import timings
from duo.api.responses.items import Event, OutputItems, new_id
from duo.api.responses.tools import ResponsesTools, chat_call
from duo.api.serving.choices import Choice
from duo.api.serving.generate import Piece
from duo.api.serving.request import ShuttingDown
from duo.api.tools import CallFormat, FunctionBody

# While nothing else is sent (the prompt read), a response.in_progress this often: Codex drops a stream silent for
# 5 minutes (stream_idle_timeout_ms) and sends it again, and an agent's prompt read on one core outlasts that.
KEEPALIVE_S = 10.0
# Keeps a finished response's conversation for previous_response_id: (response id, its output as chat messages).
Keep = Callable[[str, list[dict[str, Any]]], None]


class ResponsesFormat:
    """One response's shape, for duo.api.http.answering: whole() or events(). `settings`: the request's
    settings the response repeats (ResponsesBody.echo); the answer's text is split into content, reasoning and calls
    of `functions` as chat's is (duo.api.output.deltas), each call an item of the tool `tools` offered it for; `keep`,
    where the response is to be held, gets its output as chat messages once it is done. As llama-server's, the
    stream's last event carries the timings, and with `timings_per_token` each piece's last event too."""

    def __init__(self, model: str, settings: dict[str, Any], functions: Sequence[FunctionBody] | None,
                 call_format: CallFormat | None, keep: Keep | None = None,
                 tools: ResponsesTools | None = None, timings_per_token: bool = False) -> None:
        self.model = model
        self.settings = settings
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.functions, self.call_format = functions, call_format
        self.splitter: AnswerSplitter | None = None  # made on the first piece, which says how its reasoning reads
        self.items = OutputItems(tools)
        self.keep = keep
        self.timings_per_token = timings_per_token
        self.sequence = 0

    def whole(self, pieces: list[Piece]) -> dict[str, Any]:
        last = pieces[-1]
        text = "".join(piece.text for piece in pieces)
        self.items.feed(whole_answer(text, self.functions, self.call_format, last.reasoning))
        self._finish(last)
        return self._final(last)

    async def events(self, choice: Choice, include_usage: bool) -> AsyncIterator[str]:
        """The stream: response.created and .in_progress, each item's events, then response.completed (or
        .incomplete where the length ran out) with the whole response; a failure is an `error` event and
        response.failed. While nothing else is sent (the prompt read) a response.in_progress goes out every
        KEEPALIVE_S. `include_usage` does not apply: the last event carries the usage."""
        for kind in ("response.created", "response.in_progress"):
            yield self._sse({"type": kind, "response": self._response("in_progress", [])})
        try:
            events = kept_alive(choice, KEEPALIVE_S, self._events_of,
                                lambda: {"type": "response.in_progress", "response": self._response("in_progress", [])})
            async with aclosing(events):
                async for event in events:
                    yield self._sse(event)
        except ShuttingDown as error:
            for event in self._failed(api_error(error)):
                yield event
        except Exception as error:  # this request's own failure: it alone ends, with OpenAI's failure events
            for event in self._failed(generation_error(error)):
                yield event

    def _events_of(self, piece: Piece) -> list[Event]:
        """What one piece adds to the stream: its items' events, and the response's end where it is the last; a piece
        that tells the prompt's read (return_progress), a response.in_progress carrying it, as llama-server's."""
        if piece.progress is not None:
            return [progress_event({"type": "response.in_progress", "response": self._response("in_progress", [])},
                                   piece.progress, self.timings_per_token)]
        if self.splitter is None:  # the prompt is read: whether it opened reasoning is known
            self.splitter = answer_splitter(self.functions, self.call_format, reasoning=piece.reasoning)
        events = self.items.feed(self.splitter.feed(piece.text))
        if piece.finish_reason:
            events += self._finish(piece)
            final = self._final(piece)
            events.append({"type": f"response.{final['status']}", "response": final, "timings": timings(piece.stats)})
        elif events and self.timings_per_token:
            events[-1]["timings"] = timings(piece.stats)
        return events

    def _finish(self, last: Piece) -> list[Event]:
        """The stream's last deltas and the items' closing events; the response is held from now on where it is
        kept."""
        events = self.items.feed(self.splitter.finish()) if self.splitter is not None else []
        events += self.items.finish("incomplete" if last.finish_reason == "length" else "completed")
        if self.keep is not None:
            self.keep(self.id, output_messages(self.items.items))
        return events

    def _final(self, last: Piece) -> dict[str, Any]:
        incomplete = last.finish_reason == "length"
        response = self._response("incomplete" if incomplete else "completed", self.items.items)
        response.update(usage=usage(last), duo_stats=last.stats.fields(last.draft_connected))
        if incomplete:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        return response

    def _failed(self, error: ApiError) -> list[str]:
        failed = self._response("failed", self.items.items)
        failed["error"] = {"code": "invalid_prompt" if error.status == 400 else "server_error",
                           "message": str(error)}
        return [self._sse({"type": "error", "code": error.code or error.type, "message": str(error),
                           "param": error.param}),
                self._sse({"type": "response.failed", "response": failed})]

    def _response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": None, "model": self.model, "output": list(output),
                "usage": None, **self.settings}

    def _sse(self, event: Event) -> str:
        """`event` numbered, as a server-sent event named by its type (the Responses API streams no [DONE])."""
        numbered = {**event, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(numbered, ensure_ascii=False)}\n\n"


def usage(piece: Piece) -> dict[str, Any]:
    """The Responses API's usage. Reasoning tokens are not told apart from the others (0): the text they decode to
    is split after sampling."""
    prompt, generated = piece.stats.prompt_tokens, piece.stats.generated_tokens
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": piece.stats.cached_prompt_tokens},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated}


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages that continue its conversation: its text and calls on one
    assistant message (its reasoning left out, as chat templates leave out earlier turns' reasoning)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [chat_call(item) for item in items if item["type"] in ("function_call", "custom_tool_call")]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]
