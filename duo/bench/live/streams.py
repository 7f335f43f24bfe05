"""Server-sent-event streams as the agents read them: parsed, checked to end as their protocol ends, and searched
for the tool call an answer made and for the result a later request returns for it."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class Event:
    name: str  # the `event:` field, "" where the stream names none
    data: str


def events(stream: bytes) -> list[Event]:
    """The events of an SSE stream (blank-line separated; `data:` lines joined; comments skipped)."""
    found = []
    for block in stream.decode().replace("\r\n", "\n").split("\n\n"):
        name, data = "", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            found.append(Event(name, "\n".join(data)))
    return found


def malformations(path: str, stream: bytes) -> list[str]:
    """What is wrong with a model call's stream, by its protocol's rules: empty where it is well formed."""
    found = events(stream)
    if not found:
        return ["no events"]
    if path.endswith("/chat/completions"):
        return chat_malformations(found)
    payloads = []
    for event in found:
        try:
            payloads.append(json.loads(event.data))
        except ValueError:
            return [f"not JSON: {event.data[:200]!r}"]
    types = [p.get("type") for p in payloads]
    if path.endswith("/messages"):
        problems = [f"event {e.name!r} carries type {t!r}" for e, t in zip(found, types) if e.name != t]
        if types[0] != "message_start" or types[-1] != "message_stop":
            problems.append(f"begins with {types[0]!r} and ends with {types[-1]!r}")
        return problems
    # Responses: sequence numbers in order; created first, one terminal event last.
    numbers = [p.get("sequence_number") for p in payloads]
    problems = [] if numbers == list(range(numbers[0], numbers[0] + len(numbers))) else [f"sequence {numbers}"]
    if types[0] != "response.created" or types[-1] not in ("response.completed", "response.incomplete"):
        problems.append(f"begins with {types[0]!r} and ends with {types[-1]!r}")
    return problems


def chat_malformations(found: list[Event]) -> list[str]:
    if found[-1].data != "[DONE]":
        return [f"ends with {found[-1].data[:200]!r}, not [DONE]"]
    for event in found[:-1]:
        try:
            chunk = json.loads(event.data)
        except ValueError:
            return [f"not JSON: {event.data[:200]!r}"]
        if chunk.get("object") != "chat.completion.chunk":
            return [f"not a chunk: {event.data[:200]!r}"]
    return []


def called(path: str, stream: bytes) -> list[tuple[str, str]]:
    """(call id, tool name) of each tool call a model call's stream made."""
    calls = []
    for event in events(stream):
        if event.data == "[DONE]":
            continue
        payload = json.loads(event.data)
        if path.endswith("/responses"):
            item = payload.get("item") or {}
            if payload.get("type") == "response.output_item.done" and item.get("type") == "function_call":
                calls.append((item["call_id"], item["name"]))
        elif path.endswith("/messages"):
            block = payload.get("content_block") or {}
            if payload.get("type") == "content_block_start" and block.get("type") == "tool_use":
                calls.append((block["id"], block["name"]))
        else:
            for choice in payload.get("choices") or []:
                for call in (choice.get("delta") or {}).get("tool_calls") or []:
                    if call.get("id"):
                        calls.append((call["id"], (call.get("function") or {}).get("name")))
    return calls


def returned_results(path: str, body: dict) -> list[str]:
    """The call ids whose results a model call's body carries back."""
    if path.endswith("/responses"):
        items = body.get("input") if isinstance(body.get("input"), list) else []
        return [item["call_id"] for item in items if item.get("type") == "function_call_output"]
    if path.endswith("/messages"):
        return [block["tool_use_id"] for message in body.get("messages") or []
                if isinstance(message.get("content"), list)
                for block in message["content"] if block.get("type") == "tool_result"]
    return [message["tool_call_id"] for message in body.get("messages") or [] if message.get("role") == "tool"]
