"""An answer's text as the events every API streams: content, reasoning, and tool calls opened, argued and closed.

Chat completions, the Responses API and the Messages API all shape the same events (AnswerSplitter): a call is
opened with its name, its JSON arguments follow in pieces as they commit, and it is closed whole. Content and
reasoning come as text deltas between calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, Sequence

from duo.api.output.events import CallArguments, CallClosed, CallOpened, Delta, ReasoningDelta, TextDelta
from duo.api.tools import CallFormat, FunctionBody
from duo.api.output.calls.splitter import CallSplitter
from duo.api.output.scanning import partial_suffix

__all__ = ["CallArguments", "CallClosed", "CallOpened", "Delta", "ReasoningDelta", "TextDelta", "AnswerSplitter",
           "ContentSplitter", "Reasoning", "ReasoningFormat", "ReasoningSplitter", "answer_splitter", "whole_answer"]


# llama-server's reasoning_format: "none" leaves the reasoning in the content; "deepseek" (its default) splits it
# out; "deepseek-legacy" splits it out of whole answers but streams it in the content, tags and all.
ReasoningFormat = Literal["none", "deepseek", "deepseek-legacy"]


@dataclass(frozen=True)
class Reasoning:
    """How an answer's reasoning is told from its content."""

    format: ReasoningFormat = "deepseek"
    opened: bool = False  # the prompt opened the reasoning (the template wrote <think>): the answer starts inside it


class AnswerSplitter(Protocol):
    """Splits the model's text, as it streams, into Deltas."""

    broken: bool  # a call that was opened turned out malformed (a whole answer is then read as content)

    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]:
        """What is left at the end of the answer."""


class ContentSplitter:
    """All text is content (no tools offered)."""

    broken = False

    def feed(self, text: str) -> list[Delta]:
        return [TextDelta(text)] if text else []

    def finish(self) -> list[Delta]:
        return []


class ReasoningSplitter:
    """The reasoning block that opens an answer (<think>...</think>, or the format's own markers) as ReasoningDeltas,
    stripped, as llama.cpp's try_parse_reasoning reads it; the rest goes to `inner`. An unclosed block is reasoning
    to the end. `in_content`: the reasoning streams as content instead, in its tags (deepseek-legacy)."""

    def __init__(self, inner: AnswerSplitter, markers: tuple[str, str], opened: bool, in_content: bool) -> None:
        self.inner = inner
        self.open, self.close = markers
        self.state = "thinking" if opened else "start"
        self.in_content = in_content
        self.buffer = ""
        self.said = False  # some reasoning went out (its leading space is dropped)

    @property
    def broken(self) -> bool:
        return self.inner.broken

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        return self._run(final=True) + self.inner.finish()

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if self.state == "start":
                head = self.buffer.lstrip()
                if head.startswith(self.open):
                    self.buffer, self.state = head[len(self.open):], "thinking"
                    continue
                if not final and self.open.startswith(head):
                    return out  # maybe the opening: wait for more
                self.state = "answer"
            elif self.state == "thinking":
                if not self._think(out, final):
                    return out
            else:
                if self.state == "after":  # the space after the block is not content
                    self.buffer = self.buffer.lstrip()
                    if not self.buffer and not final:
                        return out
                    self.state = "answer"
                text, self.buffer = self.buffer, ""
                return out + (self.inner.feed(text) if text else [])

    def _think(self, out: list[Delta], final: bool) -> bool:
        """Reasoning up to the block's close (True: it closed) or up to what may be its close or trailing space."""
        end = self.buffer.find(self.close)
        if end >= 0:
            self._say(out, self.buffer[:end].rstrip(), closed=True)
            self.buffer, self.state = self.buffer[end + len(self.close):], "after"
            return True
        # Held: what may begin the close, and the space before it (the reasoning is stripped).
        said = self.buffer if final else self.buffer[:len(self.buffer) - partial_suffix(self.buffer,
                                                                                        self.close)].rstrip()
        self._say(out, said, closed=False)
        self.buffer = self.buffer[len(said):]
        return False

    def _say(self, out: list[Delta], text: str, closed: bool) -> None:
        if not self.said:
            text = text.lstrip()
        if text and not self.said and self.in_content:
            out.append(TextDelta(self.open))
        if text:
            self.said = True
            out.append(TextDelta(text) if self.in_content else ReasoningDelta(text))
        if closed and self.said and self.in_content:
            out.append(TextDelta(self.close))



def answer_splitter(functions: Sequence[FunctionBody] | None, format_: CallFormat | None, *,
                    reasoning: Reasoning = Reasoning(), streamed: bool = True) -> AnswerSplitter:
    """The splitter for an answer that may call `functions` in the template's `format_` (neither: content only),
    its reasoning told apart as `reasoning` says; `streamed`: the answer goes out as it comes (deepseek-legacy then
    keeps its reasoning in the content)."""
    inner: AnswerSplitter = CallSplitter(functions, format_) if functions and format_ else ContentSplitter()
    if reasoning.format == "none":
        return inner
    markers = format_.think if format_ else ("<think>", "</think>")
    return ReasoningSplitter(inner, markers, reasoning.opened,
                             in_content=streamed and reasoning.format == "deepseek-legacy")


def whole_answer(text: str, functions: Sequence[FunctionBody] | None, format_: CallFormat | None,
                 reasoning: Reasoning = Reasoning()) -> list[Delta]:
    """A whole answer's deltas; where a call in it turns out malformed, all of it but the reasoning is content (as
    llama.cpp reads a whole answer that fails to parse)."""
    splitter = answer_splitter(functions, format_, reasoning=reasoning, streamed=False)
    deltas = splitter.feed(text) + splitter.finish()
    if not splitter.broken:
        return deltas
    plain = answer_splitter(None, format_, reasoning=reasoning, streamed=False)
    return plain.feed(text) + plain.finish()
