"""What the Messages API answers: a message of content blocks (text, thinking, tool_use), whole or as Anthropic's
server-sent events (message_start, content_block_start / _delta / _stop per block, message_delta, message_stop)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from duo.api.openai.errors import api_error, generation_error
from duo.api.serving.choices import Choice
from duo.api.serving.generate import Piece
from duo.api.output.deltas import (AnswerSplitter, CallClosed, CallOpened, Delta, ReasoningDelta, TextDelta,
                                   answer_splitter, whole_answer)
from duo.api.anthropic.errors import error_body
from duo.api.anthropic.translate import anthropic_id
from duo.api.serving.request import ShuttingDown
from duo.api.output.beats import kept_alive
from duo.target.request import GenerationStats

if TYPE_CHECKING:  # as duo.api.output.deltas names them: the tools package builds on these events
    from duo.api.tools import CallFormat, FunctionBody

Event = dict[str, Any]  # one server-sent event's data; its "type" names the event
# How often a stream says that it is alive (a ping) when it has nothing else to send: while the prompt is read, and
# while a call is written (its input is sent whole at its end). Claude Code drops a stream silent for 5 minutes
# (CLAUDE_STREAM_IDLE_TIMEOUT_MS) and sends it again: an agent's long prompt read on one core, or a long file written
# in a call, outlasts that.
PING_INTERVAL_S = 10.0
# The places a cut call's input is tried at, from its end back (each a JSON parse of it): a cut in a string or a
# number stops at the first; text that is no JSON is not tried all through.
CUT_TRIES = 16


def tool_input(arguments: str) -> str:
    """The JSON of a call's tool_use input: the model's arguments where they are a JSON object, else {}, as
    llama-server answers. Small models write Python's {'city': 'Paris'} or a bare True, which Chat and the Responses
    API pass on as text, but a tool_use's input is an object. The JSON must be strict: Python reads NaN, Infinity, a
    number beyond a float (1e999) and a lone surrogate ("\\ud800"), which the answer's encoder, and the SDK's
    reader, refuse."""
    try:
        value = json.loads(arguments, parse_constant=_not_json)
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # UnicodeEncodeError (a lone surrogate) is a ValueError
        return "{}"
    return arguments if isinstance(value, dict) else "{}"


def cut_input(arguments: str) -> str:
    """The input of a call cut off (by max_tokens) as Anthropic streams one: what was written, incomplete, as far as
    it is the start of a JSON object, which the SDK's partial reader completes; "{}" where it is none."""
    head = arguments.lstrip()
    for end in reversed(_value_ends(head)[-CUT_TRIES:]):
        if tool_input(head[:end] + _closing(head[:end])) != "{}":
            return head[:end]
    return "{" if head.startswith("{") else "{}"


def _value_ends(text: str) -> list[int]:
    """Where a JSON object's text may stop and still be completed by closing what is open: after its opening
    brace or bracket, a value, or inside a value's string (every place in it but an escape's middle), in order."""
    ends, stack, in_string, escaped, key = [], [], False, False, False
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
                continue
            elif char == '"':
                in_string = False
                if not key:
                    ends.append(i + 1)
                continue
            if not key and not escaped:
                ends.append(i + 1)  # a value's string cut here is closed by its quote
        elif char == '"':
            in_string, key = True, bool(stack) and stack[-1][0] == "{" and stack[-1][1]
        elif char in "{[":
            stack.append([char, char == "{"])  # an object expects a key first
            ends.append(i + 1)
        elif char in "}]" and stack:
            stack.pop()
            ends.append(i + 1)
        elif char == ":" and stack:
            stack[-1][1] = False
        elif char == "," and stack:
            stack[-1][1] = stack[-1][0] == "{"
        elif not char.isspace():
            ends.append(i + 1)  # a number or a literal, maybe whole: json.loads tells
    return ends


def _closing(text: str) -> str:
    """What closes `text`: the string left open, then the brackets, innermost first."""
    stack, in_string, escaped = [], False, False
    for char in text:
        if in_string:
            escaped = not escaped and char == "\\"
            in_string = escaped or char != '"'
        elif char == '"':
            in_string = True
        elif char in "{[":
            stack.append("}" if char == "{" else "]")
        elif char in "}]" and stack:
            stack.pop()
    return ('"' if in_string else "") + "".join(reversed(stack))


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is no JSON")


class ContentBlocks:
    """An answer's Deltas as Anthropic's content block events. Blocks are numbered in the order they open, as the
    SDK assembles them (by position): text and reasoning each open a block where the block before is of another
    kind; each call is a block of its own, its input sent whole, in one input_json_delta, as the call closes. Whether
    the model's arguments are a JSON object is known only at their end (and events once sent cannot be taken back),
    so that the streamed input is the whole answer's, and never a piece that the SDK's reader refuses."""

    def __init__(self) -> None:
        self.opened = 0  # blocks opened so far
        self.kind: str | None = None  # the open block's type
        self.calls = 0  # calls closed

    def feed(self, deltas: Iterable[Delta]) -> list[Event]:
        events: list[Event] = []
        for delta in deltas:
            if isinstance(delta, TextDelta) and delta.text:
                events += self._text("text", "text_delta", delta.text)
            elif isinstance(delta, ReasoningDelta) and delta.text:
                events += self._text("thinking", "thinking_delta", delta.text)
            elif isinstance(delta, CallOpened):
                events += self._open({"type": "tool_use", "id": anthropic_id(delta.id), "name": delta.name,
                                      "input": {}})
            elif isinstance(delta, CallClosed):
                arguments = cut_input(delta.call.arguments) if delta.cut else tool_input(delta.call.arguments)
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
                events += self.close()
                self.calls += 1
        return events

    def close(self) -> list[Event]:
        """The open block's end, if one is open."""
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.opened - 1}]

    def _text(self, kind: str, delta_type: str, text: str) -> list[Event]:
        field = "text" if kind == "text" else "thinking"
        opening = [] if self.kind == kind else self._open({"type": kind, field: "", **(
            {"signature": ""} if kind == "thinking" else {})})  # a local model signs nothing
        return opening + [self._delta({"type": delta_type, field: text})]

    def _open(self, block: dict[str, Any]) -> list[Event]:
        events = self.close()
        self.kind = block["type"]
        self.opened += 1
        return events + [{"type": "content_block_start", "index": self.opened - 1, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": self.opened - 1, "delta": delta}


def assembled(events: Iterable[Event]) -> list[dict[str, Any]]:
    """The content blocks that `events` stream, as a whole answer holds them (a call's input parsed: tool_input's)."""
    blocks: list[dict[str, Any]] = []
    arguments: dict[int, str] = {}
    for event in events:
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "input_json_delta":
                arguments[event["index"]] = arguments.get(event["index"], "") + delta["partial_json"]
            else:
                field = "text" if delta["type"] == "text_delta" else "thinking"
                block[field] += delta[field]
    for index, text in arguments.items():
        blocks[index]["input"] = json.loads(text)
    return blocks


def usage(stats: GenerationStats) -> dict[str, int]:
    """Anthropic's usage: input_tokens counts the prompt tokens not read from the cache, cache_read_input_tokens
    those that were (their sum is the prompt, as count_tokens counts it); duo writes no cache entries of its own."""
    cached = stats.cached_prompt_tokens
    return {"input_tokens": stats.prompt_tokens - cached, "output_tokens": stats.generated_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


class MessagesFormat:
    """The Messages API's answer to one request, whole (`whole`) or streamed (`events`), for duo.api.http.answering.
    The model's text is split into content, reasoning and calls of `functions` in the template's `call_format`
    (duo.api.output.deltas), its reasoning told apart as the pieces say (the prompt may have opened it)."""

    def __init__(self, model: str, functions: Sequence[FunctionBody], call_format: CallFormat | None) -> None:
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex}"
        self.functions = list(functions)
        self.call_format = call_format

    def whole(self, pieces: list[Piece]) -> dict[str, Any]:
        last = pieces[-1]
        blocks = ContentBlocks()
        text = "".join(piece.text for piece in pieces)
        events = blocks.feed(whole_answer(text, self.functions, self.call_format, last.reasoning)) + blocks.close()
        return {**self._message(assembled(events), last.stats), **self._stop(pieces, blocks.calls),
                "duo_stats": last.stats.fields(last.draft_connected)}

    async def events(self, choice: Choice, include_usage: bool) -> AsyncIterator[str]:
        """The answer's events as it streams; `include_usage` does not apply (the whole usage comes with
        message_delta, as Anthropic sends it). message_start comes at once, before the prompt is read, its
        input_tokens the prompt's (as llama-server's; which of them the cache holds, message_delta says), and a ping
        whenever PING_INTERVAL_S passed with no other event. A failure ends the stream with an error event."""
        blocks = ContentBlocks()
        splitter: AnswerSplitter | None = None
        pieces: list[Piece] = []
        yield sse({"type": "message_start",
                   "message": self._message([], GenerationStats(prompt_tokens=choice.prompt_tokens))})
        yield sse({"type": "ping"})
        def events_of(piece: Piece) -> list[Event]:
            nonlocal splitter
            if splitter is None:  # the prompt is read: whether it opened reasoning is known
                splitter = answer_splitter(self.functions, self.call_format, reasoning=piece.reasoning)
            pieces.append(piece)
            events = blocks.feed(splitter.feed(piece.text))
            if piece.finish_reason:
                events += self._ending(blocks, splitter, pieces)
            return events

        try:
            events = kept_alive(choice, PING_INTERVAL_S, events_of, lambda: {"type": "ping"})
            async with aclosing(events):
                async for event in events:
                    yield sse(event)
        except ShuttingDown as error:
            yield _error_event(api_error(error).status, str(error))
        except Exception as error:  # this request's own failure: an error event ends the stream
            failure = generation_error(error)
            yield _error_event(failure.status, str(failure))

    def _ending(self, blocks: ContentBlocks, splitter: AnswerSplitter, pieces: list[Piece]) -> list[Event]:
        """The last blocks' events, then message_delta (the stop, the whole usage) and message_stop."""
        last = pieces[-1]
        events = blocks.feed(splitter.finish()) + blocks.close()
        return events + [{"type": "message_delta", "delta": self._stop(pieces, blocks.calls),
                          "usage": usage(last.stats), "duo_stats": last.stats.fields(last.draft_connected)},
                         {"type": "message_stop"}]

    def _message(self, content: list[dict[str, Any]], stats: GenerationStats) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": None, "stop_sequence": None, "usage": usage(stats)}

    def _stop(self, pieces: list[Piece], calls: int) -> dict[str, Any]:
        """stop_reason and stop_sequence: max_tokens where the answer ran out of tokens (or context), as Anthropic
        and llama-server say whatever it wrote; else tool_use where the model called a tool, stop_sequence where one
        of the request's ended it, else end_turn."""
        last = pieces[-1]
        if last.finish_reason == "length":  # first: a call the tokens ran out in is no finished tool_use
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if last.stop_word:
            return {"stop_reason": "stop_sequence", "stop_sequence": last.stop_word}
        return {"stop_reason": "end_turn", "stop_sequence": None}


def sse(data: Event) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _error_event(status: int, message: str) -> str:
    return sse(error_body(status, message))
