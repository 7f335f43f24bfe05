"""A JSON value checked as its text arrives (JsonCheck): a call held until whole (duo.api.output.calls.reader) is
known to be text at the first character that cannot continue its JSON, not only at the answer's end."""

from __future__ import annotations

import re


class Broken(Exception):
    """The character cannot go on the JSON value read so far."""


# What may stand in a JSON literal or number (checked whole where it ends), and what may follow a backslash in a string.
LITERALS = ("true", "false", "null")
NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
NUMBER_CHARS = frozenset("0123456789+-.eE")
ESCAPES = frozenset('"\\/bfnrtu')
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
CLOSERS = {"{": "}", "[": "]"}
JSON_SPACE = frozenset(" \t\n\r")  # RFC 8259's whitespace: no other space may stand between tokens


class JsonCheck:
    """Where a JSON value ends, as its text arrives, checked as it arrives: `broken` at the first character that cannot
    continue a JSON value (RFC 8259, as json.loads and llama.cpp's parser read it). A call whose JSON breaks early (an
    unescaped quote in a string, a missing comma) is then known to be none at once, not only once its brackets happen
    to close or the answer ends: a held call's text goes out as content as soon as it is text.

    `expect` is what the next character outside strings and scalars may be: "value", "value]" (a value or the close of
    the empty array just opened), "key", "key}" (likewise for an object), ":" or "next" (a comma or the close of the
    innermost container). Example: `{"a": 1 "b"` fails at the second quote, where "next" allows only `,` or `}`."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # the open containers' brackets
        self.expect = "value"
        self.string = self.key = self.escaped = False
        self.hex = 0       # the \u escape's hex digits still to come
        self.token = ""    # the literal or number being read
        self.started = False  # the value's first character came (read by the caller: the space before it is not its)
        self.ended_before = self.broken = False

    def feed(self, text: str) -> tuple[int, bool]:
        """How much of `text` belongs to the value, and whether the value ends there; where a character cannot go on
        the value, what came before it and `broken` (the caller says what it took, then takes it for no call)."""
        i = 0
        try:
            for i, char in enumerate(text):
                if self._took(char):
                    return i + 1, True
                if self.ended_before:
                    return i, True
        except Broken:
            self.broken = True
            return i, False
        return len(text), False

    def _took(self, char: str) -> bool:
        """One character: True where it closes the value. A scalar value ends before what follows it
        (`ended_before`)."""
        if self.string:
            return self._in_string(char) and self._value_done()
        if self.token:
            if char in NUMBER_CHARS or "a" <= char <= "z":
                self._grow_token(char)
                return False
            self._end_token()
            if not self.stack:
                self.ended_before = True
                return False
        if char in JSON_SPACE:
            return False
        self.started = True
        return self._outside(char)

    def _in_string(self, char: str) -> bool:
        """A character inside a string: True where it closes the string."""
        if self.hex:
            if char not in HEX_DIGITS:
                raise Broken
            self.hex -= 1
        elif self.escaped:
            if char not in ESCAPES:
                raise Broken
            self.escaped, self.hex = False, 4 if char == "u" else 0
        elif char == "\\":
            self.escaped = True
        elif char == '"':
            self.string = False
            return True
        elif char < " ":  # control characters must be escaped (json.loads' strict reading)
            raise Broken
        return False

    def _value_done(self) -> bool:
        """A string closed: a key wants its colon; a value ends the whole where no container is open."""
        if self.key:
            self.key, self.expect = False, ":"
            return False
        return self._after_value()

    def _after_value(self) -> bool:
        self.expect = "next"
        return not self.stack

    def _grow_token(self, char: str) -> None:
        token = self.token + char
        if not (any(literal.startswith(token) for literal in LITERALS) or NUMBER_CHARS.issuperset(token)):
            raise Broken
        self.token = token

    def _end_token(self) -> None:
        if self.token not in LITERALS and not NUMBER.fullmatch(self.token):
            raise Broken
        self.token = ""
        self._after_value()

    def _outside(self, char: str) -> bool:
        """A character outside strings and scalars, as `expect` allows: True where it closes the value."""
        expect = self.expect
        if expect == ":":
            if char != ":":
                raise Broken
            self.expect = "value"
        elif expect == "next":
            if char == ",":
                self.expect = "key" if self.stack[-1] == "{" else "value"
            elif char == CLOSERS[self.stack[-1]]:
                self.stack.pop()
                return self._after_value()
            else:
                raise Broken
        elif expect in ("value]", "key}") and char == expect[-1]:  # the empty container just opened closes
            self.stack.pop()
            return self._after_value()
        elif expect.startswith("key"):
            if char != '"':
                raise Broken
            self.string = self.key = True
        elif char in CLOSERS:
            self.stack.append(char)
            self.expect = "key}" if char == "{" else "value]"
        elif char == '"':
            self.string = True
        elif char == "-" or "0" <= char <= "9" or char in "tfn":
            self._grow_token(char)
        else:
            raise Broken
        return False
