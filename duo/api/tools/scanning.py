"""Reading call text that may be cut anywhere: where a JSON value ends, a JSON string's text so far, Qwen3-Coder's
XML parameters as JSON; More where the text may go on into what is read, NotCall where it cannot."""

from __future__ import annotations

import json
from typing import Any

from duo.api.tools.messages import FunctionBody

MAX_HEADER = 256  # a function's name, and what stands around it in a header, is never longer


class More(Exception):
    """The text so far stops inside what is being read: wait for more."""


class NotCall(Exception):
    """The text is no well-formed call of an offered function."""


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may be the start of one)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class Text:
    """A cursor on the text of the calls; `final`: no more text comes (the answer has ended)."""

    def __init__(self, text: str, final: bool) -> None:
        self.text, self.final, self.at = text, final, 0

    def rest(self) -> str:
        return self.text[self.at:]

    def at_end(self) -> bool:
        return self.at >= len(self.text)

    def space(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def starts(self, literal: str) -> bool:
        """Whether `literal` comes next; More while the text so far may still become it."""
        rest = self.rest()
        if rest.startswith(literal):
            return True
        if literal.startswith(rest):
            self.more()
        return False

    def literal(self, literal: str) -> bool:
        if self.starts(literal):
            self.at += len(literal)
            return True
        return False

    def expect(self, literal: str) -> None:
        if not self.literal(literal):
            raise NotCall

    def until(self, end: str) -> str:
        """The text up to `end`, passed."""
        found = self.text.find(end, self.at, self.at + MAX_HEADER + len(end))
        if found < 0:
            if len(self.text) - self.at > MAX_HEADER + len(end):
                raise NotCall
            self.more()
        text, self.at = self.text[self.at:found], found + len(end)
        return text

    def json_key(self) -> str:
        """A JSON object's next key, passed with its colon."""
        self.space()
        if not self.starts('"'):
            raise NotCall
        key = self.json_value()
        self.space()
        self.expect(":")
        self.space()
        return key

    def json_value(self) -> Any:
        """The JSON value that comes next, passed."""
        self.space()
        scan = JsonEnd()
        used, done = scan.feed(self.rest())
        if not done and not (self.final and scan.scalar):
            self.more()
        try:
            value = json.loads(self.rest()[:used])
        except (ValueError, RecursionError):
            raise NotCall from None
        self.at += used
        return value

    def more(self) -> None:
        raise NotCall if self.final else More


class JsonEnd:
    """Where a JSON value ends, as its text arrives: strings, their escapes and the depth of brackets followed."""

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
        end = text.find("</parameter>", at)
        if end < 0 and final:
            raise NotCall
        if self.properties.get(self.key or "", {}).get("type") != "string":  # a number, an object: whole at its end
            if end < 0:
                return "", at, False
            self.key = None
            value = text[at:end].removeprefix("\n").removesuffix("\n")
            return _as_json(value), end + len("</parameter>"), True
        piece = ""
        if self.lead:  # the value starts on the line after its tag
            if at == len(text):
                return "", at, False
            at, self.lead, piece = at + (text[at] == "\n"), False, '"'
        if end < 0:
            held = partial_suffix(text[at:], "\n</parameter>")
            return piece + _escaped(text[at:len(text) - held]), len(text) - held, False
        self.key = None
        return piece + _escaped(text[at:end].removesuffix("\n")) + '"', end + len("</parameter>"), True


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _as_json(value: str) -> str:
    try:
        return json.dumps(json.loads(value), ensure_ascii=False)
    except (ValueError, RecursionError):
        return json.dumps(value, ensure_ascii=False)
