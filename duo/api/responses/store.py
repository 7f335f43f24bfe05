"""Recent responses' conversations, held in memory for previous_response_id: bounded in count and size, the least
recently used dropped first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from duo.api.serving.request import BadRequest

Conversation = tuple[dict[str, Any], ...]
MAX_RESPONSES = 256
# What the held conversations may take together (their strings' characters, and an allowance for each entry): a client
# chaining long conversations must not grow the server's memory without bound; the oldest go first.
MAX_CHARACTERS = 64 * 1024 * 1024
# What each object, list and string is counted for beside its characters: many empty ones take memory too (a CPython
# object takes 50 bytes or more, so the bound holds the memory to a small multiple of itself).
ENTRY_CHARACTERS = 16


class ResponseStore:
    """Response id -> the conversation up to and including that response, as chat messages (instructions left out:
    OpenAI does not carry them over to the next response)."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_characters: int = MAX_CHARACTERS) -> None:
        self.max_responses = max_responses
        self.max_characters = max_characters
        # Each conversation as a tuple its readers extend and never change: held and read without a copy.
        self._held: OrderedDict[str, tuple[Conversation, int]] = OrderedDict()
        self._characters = 0

    def __len__(self) -> int:
        return len(self._held)

    def conversation(self, response_id: str) -> Conversation:
        """The conversation response `response_id` ended; BadRequest naming previous_response_id where it is not
        held (never stored, store false, or dropped for newer ones)."""
        held = self._held.get(response_id)
        if held is None:
            raise BadRequest(f"previous_response_id {response_id!r} is not held by this server: it keeps the last "
                             f"{self.max_responses} stored responses in memory, not across restarts; send the whole "
                             "conversation as input instead", param="previous_response_id",
                             code="previous_response_not_found")
        self._held.move_to_end(response_id)
        return held[0]

    def keep(self, response_id: str, messages: Conversation, size: int) -> None:
        """Hold `messages`, of `size` (characters(messages), counted off the event loop by the caller)."""
        if size > self.max_characters:
            return  # larger than all the room there is: holding it would drop every other
        self._held[response_id] = (messages, size)
        self._characters += size
        while len(self._held) > self.max_responses or self._characters > self.max_characters:
            _, (_, dropped) = self._held.popitem(last=False)
            self._characters -= dropped


def characters(messages: Sequence[dict[str, Any]]) -> int:
    """About what `messages` take: every string they hold (roles, contents, ids, names, arguments: a long one the
    template never writes takes memory all the same) and ENTRY_CHARACTERS for each object, list and string beside
    its text; counted, not serialized, and off the event loop: a held conversation may run to megabytes."""
    total, waiting = 0, list(messages)
    while waiting:
        value = waiting.pop()
        total += ENTRY_CHARACTERS
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict):
            waiting += value.keys()
            waiting += value.values()
        elif isinstance(value, (list, tuple)):
            waiting += value
    return total
