"""Reading call text that may be cut anywhere: a cursor whose steps wait for more text where it stops inside what
they read (NotCall where no more comes, or where the text cannot be a call), where a JSON value ends, a JSON
string's text so far, Qwen3-Coder's XML parameters as JSON."""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any, TypeVar

from duo.api.tools.messages import FunctionBody

MAX_HEADER = 256  # a function's name, and what stands around it in a header, is never longer
PARAMETER_END = "</parameter>"  # what ends a Qwen3-Coder parameter's value

T = TypeVar("T")
# A step of reading: it yields each time it has read all the text there is and waits for more, and returns what it
# read. A waiting step resumes where it stopped, so that each character is read once however the text is cut.
Wait = Generator[None, None, T]


class NotCall(Exception):
    """The text is no well-formed call of an offered function."""


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may be the start of one). Only an end that
    starts with the marker's first character is tried (a splitter tries a dozen markers at every piece)."""
    at = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while at >= 0:
        if marker.startswith(text[at:]):
            return len(text) - at
        at = text.find(marker[0], at + 1)
    return 0


class Text:
    """A cursor on the text of the calls, which grows as the answer streams (`grown`); `final`: no more text comes
    (the answer has ended), and a step that would wait raises NotCall instead."""

    def __init__(self) -> None:
        self.text, self.final, self.at = "", False, 0
        self.spaced = -1  # where space() last stopped (-1: nowhere since the last cut)

    def grown(self, text: str, final: bool) -> None:
        """The text as it stands now: what it was, and what has arrived since."""
        self.text, self.final = text, final

    def cut(self) -> str:
        """The text from the cursor on, which is all the text from now on (what was read before is let go)."""
        self.text, self.at, self.spaced = self.text[self.at:], 0, -1
        return self.text

    def rest(self) -> str:
        return self.text[self.at:]

    def at_end(self) -> bool:
        return self.at >= len(self.text)

    def wait(self) -> Wait[None]:
        """Wait for more text. A step that waits right after space() resumes after the space that arrives in the
        meantime too: read at once, that text would have been skipped with the rest."""
        if self.final:
            raise NotCall
        spaced = self.at == self.spaced
        yield
        if spaced:
            self.space()

    def space(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1
        self.spaced = self.at

    def starts(self, literal: str) -> Wait[bool]:
        """Whether `literal` comes next, waiting while the text so far may still become it."""
        while not self.text.startswith(literal, self.at):
            if not literal.startswith(self.text[self.at:self.at + len(literal)]):
                return False
            yield from self.wait()
        return True

    def literal(self, literal: str) -> Wait[bool]:
        if (yield from self.starts(literal)):
            self.at += len(literal)
            return True
        return False

    def expect(self, literal: str) -> Wait[None]:
        if not (yield from self.literal(literal)):
            raise NotCall

    def until(self, end: str) -> Wait[str]:
        """The text up to `end`, passed (a header: MAX_HEADER at most, so that looking again is cheap)."""
        while (found := self.text.find(end, self.at, self.at + MAX_HEADER + len(end))) < 0:
            if len(self.text) - self.at > MAX_HEADER + len(end):
                raise NotCall
            yield from self.wait()
        text, self.at = self.text[self.at:found], found + len(end)
        return text

    def json_key(self) -> Wait[str]:
        """A JSON object's next key, passed with its colon."""
        self.space()
        if not (yield from self.starts('"')):
            raise NotCall
        key = yield from self.json_value()
        self.space()
        yield from self.expect(":")
        self.space()
        return key

    def json_value(self) -> Wait[Any]:
        """The JSON value that comes next, passed; its end is looked for in each piece of text once, as it comes."""
        self.space()
        start, scan = self.at, JsonEnd()
        while True:
            used, done = scan.feed(self.text[self.at:])
            self.at += used
            if done or self.final and scan.scalar:  # a scalar at the very end of the answer ends there
                break
            yield from self.wait()
        try:
            return json.loads(self.text[start:self.at])
        except (ValueError, RecursionError):
            raise NotCall from None


class JsonEnd:
    """Where a JSON value ends, as its text arrives: strings, their escapes and the depth of brackets followed, the
    rest unchecked (json.loads reads the value after; a call's arguments in a format's own opening are the model's text
    whatever it is, as llama-server's parsers take them: JsonCheck checks a held call's)."""

    broken = False  # (a bracket count never breaks)

    def __init__(self) -> None:
        self.depth = 0
        self.string = self.escaped = self.started = self.scalar = False

    def feed(self, text: str) -> tuple[int, bool]:
        """How much of `text` belongs to the value, and whether the value ends there."""
        for i, char in enumerate(text):
            if not self.started:
                if char.isspace():
                    continue
                self.started = True
                self.depth, self.string, self.scalar = int(char in "{["), char == '"', char not in '{["'
                if not self.scalar:
                    continue
            if self.scalar:
                if char in ",}]" or char.isspace():
                    return i, True
            elif self.string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.string = False
                    if not self.depth:
                        return i + 1, True
            elif char == '"':
                self.string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if not self.depth:
                    return i + 1, True
        return len(text), False


class JsonString:
    """A JSON string's text as it arrives (the generic format's response): escapes decoded once whole."""

    def __init__(self) -> None:
        self.opened = False

    def feed(self, text: str) -> tuple[str, int, bool]:
        """The string's text in `text`, how much of `text` it used, and whether the string ended."""
        at, out = 0, []
        if not self.opened:
            while at < len(text) and text[at].isspace():
                at += 1
            if at == len(text):
                return "", at, False
            if text[at] != '"':
                raise NotCall
            self.opened, at = True, at + 1
        while at < len(text):
            char = text[at]
            if char == '"':
                return "".join(out), at + 1, True
            if char == "\\":
                size = 6 if text[at + 1:at + 2] == "u" else 2
                if at + size > len(text):
                    break  # an escape cut off: wait for the rest of it
                try:
                    out.append(json.loads(f'"{text[at:at + size]}"'))
                except ValueError:
                    raise NotCall from None
                at += size
                continue
            out.append(char)
            at += 1
        return "".join(out), at, False


class XmlArguments:
    """Qwen3-Coder's parameters, <parameter=key>\\nvalue\\n</parameter>, as a JSON object built as they arrive: a
    string parameter's value streamed as a JSON string, any other value whole (as JSON where it parses)."""

    def __init__(self, function: FunctionBody) -> None:
        self.properties: dict[str, Any] = (function.parameters or {}).get("properties", {})
        self.opened = False
        self.first = True
        self.key: str | None = None  # the parameter whose value is being read
        self.lead = False            # the value's first line break is still to come
        self.searched = 0            # how much of a value read whole has been searched for its end

    def read(self, text: str, final: bool) -> tuple[str, int, bool]:
        """The JSON that `text` adds, how much of `text` it used, and whether the arguments are whole (at
        </function>, which is left for the caller)."""
        pieces, at = ([] if self.opened else ["{"]), 0
        self.opened = True
        while True:
            if self.key is None:
                while at < len(text) and text[at].isspace():
                    at += 1
                rest = text[at:]
                if rest.startswith("</function>"):
                    return "".join(pieces) + "}", at, True
                if rest.startswith("<parameter=") and ">" in rest:
                    end = text.index(">", at)
                    self.key, self.lead = text[at + len("<parameter="):end], True
                    pieces.append(("" if self.first else ", ") + json.dumps(self.key, ensure_ascii=False) + ": ")
                    self.first, at = False, end + 1
                    continue
                if final or not ("</function>".startswith(rest) or "<parameter=".startswith(rest[:11])):
                    raise NotCall
                return "".join(pieces), at, False
            piece, at, ended = self._value(text, at, final)
            pieces.append(piece)
            if not ended:
                return "".join(pieces), at, False

    def _value(self, text: str, at: int, final: bool) -> tuple[str, int, bool]:
        """The JSON of the current value that `text` adds from `at`, where it stopped, and whether it ended."""
        end = text.find(PARAMETER_END, at + self.searched)
        if end < 0 and final:
            raise NotCall
        if self.properties.get(self.key or "", {}).get("type") != "string":  # a number, an object: whole at its end
            if end < 0:  # the value waits, unread, for its end: the next piece's search starts where this one's ended
                self.searched = max(0, len(text) - at - len(PARAMETER_END) + 1)
                return "", at, False
            self.key, self.searched = None, 0
            value = text[at:end].removeprefix("\n").removesuffix("\n")
            return _as_json(value), end + len(PARAMETER_END), True
        piece = ""
        if self.lead:  # the value starts on the line after its tag
            if at == len(text):
                return "", at, False
            at, self.lead, piece = at + (text[at] == "\n"), False, '"'
        if end < 0:
            held = partial_suffix(text[at:], "\n" + PARAMETER_END)
            return piece + _escaped(text[at:len(text) - held]), len(text) - held, False
        self.key = None
        return piece + _escaped(text[at:end].removesuffix("\n")) + '"', end + len(PARAMETER_END), True


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _as_json(value: str) -> str:
    try:
        return json.dumps(json.loads(value), ensure_ascii=False)
    except (ValueError, RecursionError):
        return json.dumps(value, ensure_ascii=False)
