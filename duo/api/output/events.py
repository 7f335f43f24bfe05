"""The events an answer's text is split into (duo.api.output.deltas): content, reasoning, and tool calls opened, argued and
closed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from duo.api.tools.messages import ToolCall


@dataclass(frozen=True)
class TextDelta:
    """Answer text (content)."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """The model's reasoning (its <think> text), apart from the content."""

    text: str


@dataclass(frozen=True)
class CallOpened:
    """Call `index` (0, 1, ... in the answer) begins: its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """A piece of call `index`'s JSON arguments; the pieces of one call concatenate to its arguments."""

    index: int
    text: str


@dataclass(frozen=True)
class CallClosed:
    """Call `index` ends. `cut`: its text ended before the call did (the answer ran out of tokens, or the call
    turned out malformed): its arguments are what was written, no finished call."""

    index: int
    call: ToolCall
    cut: bool = False


Delta = Union[TextDelta, ReasoningDelta, CallOpened, CallArguments, CallClosed]
