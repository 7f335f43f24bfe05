"""A Responses answer's output items, built from its deltas (duo.api.output.deltas), with the stream events that build them."""

from __future__ import annotations

import uuid
from typing import Any, Sequence

from duo.api.output.deltas import CallArguments, CallClosed, CallOpened, Delta, ReasoningDelta, TextDelta
from duo.api.responses.tools import ResponsesTools, custom_input

Event = dict[str, Any]  # a stream event without its sequence_number (the stream numbers them)

# The two kinds of item that hold text, each in one content part: their part's type and their events' prefix.
TEXT_ITEMS = {"message": ("output_text", "response.output_text"),
              "reasoning": ("reasoning_text", "response.reasoning_text")}
# The id prefix of each kind of call item, as OpenAI's.
CALL_IDS = {"function_call": "fc", "custom_tool_call": "ctc"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The output items of one answer as its deltas arrive. Each item is added, filled, then done: text opens a
    message, reasoning a reasoning item, a call the item `tools` says (a function_call, or a custom_tool_call whose
    input comes whole as the call closes: it is the string inside the arguments, which stream as JSON); any of them
    closes the item before it where that was of another kind. feed() and finish() return the events a stream sends
    for them, in order."""

    def __init__(self, tools: ResponsesTools | None = None) -> None:
        self.tools = tools or ResponsesTools([])
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being filled: always the last one
        self.text = ""  # the open message's or reasoning's text so far
        self.held = ""  # whitespace with no message open: the template's layout between calls, unless text follows

    def feed(self, deltas: Sequence[Delta]) -> list[Event]:
        events: list[Event] = []
        for delta in deltas:
            if isinstance(delta, TextDelta):
                events += self._text(delta.text)
            elif isinstance(delta, ReasoningDelta):
                events += self._append("reasoning", delta.text)
            elif isinstance(delta, CallOpened):
                item = self.tools.item(delta.id, delta.name)
                item.update(id=new_id(CALL_IDS[item["type"]]), status="in_progress")
                events += self._close("completed") + self._add(item)
            elif isinstance(delta, CallArguments) and self._is_open("function_call") and delta.text:
                self.open["arguments"] += delta.text  # type: ignore[index]
                events.append(self._at({"type": "response.function_call_arguments.delta", "delta": delta.text}))
            elif isinstance(delta, CallClosed) and self._is_open("function_call"):
                events += self._call_done(delta)
            elif isinstance(delta, CallClosed) and self._is_open("custom_tool_call"):
                events += self._custom_call_done(delta)
        return events

    def finish(self, status: str) -> list[Event]:
        """The answer ended: its open item closes with `status` (incomplete where the length ran out). An answer
        with no item at all still has its message, empty or of the whitespace held."""
        events: list[Event] = []
        if not self.items:
            events += self._append("message", self.held)
        self.held = ""
        return events + self._close(status)

    def _text(self, text: str) -> list[Event]:
        if self._is_open("message"):
            return self._append("message", text)
        if text.isspace():
            self.held += text
            return []
        text, self.held = self.held + text, ""
        return self._append("message", text)

    def _is_open(self, kind: str) -> bool:
        return self.open is not None and self.open["type"] == kind

    def _append(self, kind: str, text: str) -> list[Event]:
        """`text` on the open item of `kind`, which is added (with its one content part) where it is not open."""
        events: list[Event] = []
        if not self._is_open(kind):
            item: dict[str, Any] = {"type": kind, "id": new_id("msg" if kind == "message" else "rs"),
                                    "status": "in_progress", "content": []}
            if kind == "message":
                item["role"] = "assistant"
            else:
                item["summary"] = []
            events += self._close("completed") + self._add(item)
            events.append(self._at({"type": "response.content_part.added", "content_index": 0,
                                    "part": _part(kind, "")}))
        self.text += text
        if not text:
            return events
        delta = {"type": f"{TEXT_ITEMS[kind][1]}.delta", "content_index": 0, "delta": text}
        if kind == "message":
            delta["logprobs"] = []
        return events + [self._at(delta)]

    def _call_done(self, closed: CallClosed) -> list[Event]:
        item = self.open
        assert item is not None
        item["arguments"] = closed.call.arguments  # the whole call's, as parsed: the pieces' sum
        events = [self._at({"type": "response.function_call_arguments.done", "arguments": item["arguments"],
                            "name": item["name"]})]
        return events + self._close(_status(closed))

    def _custom_call_done(self, closed: CallClosed) -> list[Event]:
        item = self.open
        assert item is not None
        item["input"] = custom_input(closed.call.arguments)
        events = [self._at({"type": "response.custom_tool_call_input.delta", "delta": item["input"]}),
                  self._at({"type": "response.custom_tool_call_input.done", "input": item["input"]})]
        return events + self._close(_status(closed))

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        self.open, self.text = item, ""
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _shown(item)}]

    def _close(self, status: str) -> list[Event]:
        """The open item's closing events (none open: none)."""
        item = self.open
        if item is None:
            return []
        events: list[Event] = []
        if item["type"] in TEXT_ITEMS:
            item["content"] = [_part(item["type"], self.text)]
            done = {"type": f"{TEXT_ITEMS[item['type']][1]}.done", "content_index": 0, "text": self.text}
            if item["type"] == "message":
                done["logprobs"] = []
            events += [self._at(done), self._at({"type": "response.content_part.done", "content_index": 0,
                                                 "part": item["content"][0]})]
        item["status"] = status
        self.open, self.text = None, ""
        return events + [{"type": "response.output_item.done", "output_index": len(self.items) - 1,
                          "item": _shown(item)}]

    def _at(self, event: Event) -> Event:
        """`event` on the open item: its id and output index."""
        assert self.open is not None
        return {**event, "item_id": self.open["id"], "output_index": len(self.items) - 1}


def _status(closed: CallClosed) -> str:
    """A call item's status: incomplete where its text was cut off (as OpenAI marks the items of an incomplete
    response), never a finished call of arguments the model did not finish."""
    return "incomplete" if closed.cut else "completed"


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _shown(item: dict[str, Any]) -> dict[str, Any]:
    """The item as an event shows it now (a copy: later events change the item, not what was sent)."""
    return {key: list(value) if isinstance(value, list) else value for key, value in item.items()}
