"""The calls after their opening, read as their text commits (CallReader), for the splitter that found them."""

from __future__ import annotations

import json
import re
from typing import Callable, Protocol

from duo.api.output.events import CallArguments, CallClosed, CallOpened, Delta
from duo.api.output.json_check import JsonCheck
from duo.api.output.scanning import JsonEnd, JsonString, NotCall, Text, Wait, XmlArguments
from duo.api.tools.formats import BARE_CALL, FENCE, FUNCTION_HEADERS, JSON_TAGS, CallFormat
from duo.api.tools.messages import FunctionBody, ToolCall

NAME_END = re.compile(r"[\s:<]")  # after a header's name: Kimi's ":0", GPT-OSS' " <|constrain|>json"


class Splitter(Protocol):
    """What a reader shares with the splitter it reads for (duo.api.output.calls.splitter.CallSplitter): the text
    not yet read, the calls' count, and where the content goes."""

    functions: dict[str, FunctionBody]
    format: CallFormat
    buffer: str
    opener: str
    count: int
    after_call: bool

    def content(self, out: list[Delta], text: str) -> None: ...

    def new_id(self) -> str: ...


class CallReader:
    """The calls after their opening, read as their text commits: each call's head (up to its arguments) whole, its
    arguments in pieces, its tail (up to the next call or the end of the calls) whole. The reading is one coroutine
    (`steps`) that waits where the text runs out and goes on from there as more arrives: a head or a tail cut into
    many pieces is read once, not again from its start at each piece."""

    def __init__(self, splitter: Splitter, wrapping: str = "") -> None:
        """`wrapping`: one of the format's other openings that opened the call ("": the format's own)."""
        self.splitter = splitter
        self.wrapping = wrapping
        self.format = splitter.format
        self.text = Text()                   # the splitter's buffer, read
        self.out: list[Delta] = []           # where the deltas of the text read now go
        self.call: CallOpened | None = None  # the call whose arguments are being read
        self.arguments: list[str] = []       # the call's argument pieces so far
        self.calls = 0                       # calls read since the opening
        self.listed = self.format.listed     # the generic format's {"tool_calls": [...]} is a list too
        self.steps = self._wrapped(wrapping) if wrapping else self._calls()
        # A call in another wrapping (a ```json block, a bare JSON object, <function=NAME>) may be text that only looks
        # like one: its events are held until it is whole, closed and its arguments valid JSON, and none goes out
        # where it turns out no call (a model's half-written ```json block, then prose: text, as llama.cpp's parser
        # reads it, not a call whose arguments no client can parse). The format's own opening streams them.
        self.holding = bool(wrapping)
        self.held: list[Delta] = []
        self.sink: list[Delta] = []          # where the events go once they are let out

    def read(self, out: list[Delta], final: bool) -> bool:
        """Read what the buffer holds: True once the calls are over, False while they wait for more text; NotCall
        where they turn out to be none."""
        self.sink = out
        self.out = self.held if self.holding else out
        self.text.grown(self.splitter.buffer, final)
        try:
            next(self.steps)
        except StopIteration:
            return True
        return False

    def _calls(self) -> Wait[None]:
        """The calls to their end (a list's, a section's, or one call's where each has an opening of its own)."""
        while not (yield from self._over()):
            name = yield from self._head()
            if name is None:  # the generic format's {"response": "..."}
                self._commit()
                yield from self._reply()
                return
            self._open(name)
            yield from self._arguments(keyed=self.format.naming in ("json", "generic"))
            yield from self._tail()
            self.out.append(self.closed())
            self.calls += 1
            if not (self.listed or self.format.section):
                return  # each call has an opening of its own: the splitter finds the next
        self._commit()

    def _wrapped(self, wrapping: str) -> Wait[None]:
        """One call in another wrapping Hermes' parser reads (HERMES_WRAPPINGS), as common_chat_parse_hermes_2_pro
        reads it: a fence's language, its line break and maybe a tag; the JSON call with its name first (or the
        header's name, then the JSON arguments); then what closes the tag (or the header) and the fence."""
        text, fenced = self.text, wrapping == FENCE
        if fenced:
            if not (yield from text.literal("json")):
                yield from text.literal("xml")
            yield from text.expect("\n")
            text.space()
            wrapping = yield from self._json_tag()
        header = FUNCTION_HEADERS.get(wrapping)
        if header:
            name = yield from text.until(header)
            if name not in self.splitter.functions:
                raise NotCall
        else:
            text.space()
            name = yield from self._json_head(name_first=True)
        assert name is not None
        self._open(name)
        yield from self._arguments(keyed=not header)
        if header:
            closes = ["</function>"]
        else:
            yield from self._object_end()
            closes = [] if wrapping == BARE_CALL else ["</" + wrapping[1:]]
        for close in closes + ([FENCE] if fenced else []):
            text.space()
            yield from text.expect(close)
        if not self._valid_arguments():
            raise NotCall
        self.out.append(self.closed())
        self._let_out()

    def _valid_arguments(self) -> bool:
        """Whether the call's arguments are a JSON object (where they came as a JSON string, its text is one)."""
        try:
            return isinstance(json.loads("".join(self.arguments)), dict)
        except ValueError:
            return False

    def _let_out(self) -> None:
        """The held call is whole: its events go out, and the text read is the calls'."""
        self.holding = False
        self.sink.extend(self.held)
        self.held, self.out = [], self.sink
        self._commit()

    def _json_tag(self) -> Wait[str]:
        """The tag that may stand between a fence's line break and its JSON call: BARE_CALL where none does."""
        for tag in JSON_TAGS:
            if (yield from self.text.literal(tag)):
                return tag
        return BARE_CALL

    def _reply(self) -> Wait[None]:
        """The generic format's {"response": "..."}: the string's text is content, as it streams."""
        yield from self._string(lambda piece: self.splitter.content(self.out, piece))
        self.text.space()
        yield from self.text.expect("}")
        self._commit()

    def _string(self, say: Callable[[str], None]) -> Wait[None]:
        """A JSON string that comes next, its text said in pieces as it commits."""
        text, string = self.text, JsonString()
        while True:
            piece, used, ended = string.feed(text.rest())
            if piece:
                say(piece)
            text.at += used
            self._commit()
            if ended:
                return
            yield from text.wait()

    def _over(self) -> Wait[bool]:
        """Whether the calls end here (their section's end, the end of a JSON list, or no further call)."""
        if not self.calls:
            return False
        text = self.text
        text.space()
        if self.listed:
            if not (yield from text.literal("]")):
                yield from text.expect(",")
                return False
            text.space()
            if self.format.naming == "generic":
                yield from text.expect("}")
            elif self.format.section_end:
                yield from text.literal(self.format.section_end)
            return True
        if self.format.section_end and (yield from text.literal(self.format.section_end)):
            return True
        while text.at_end():
            yield from text.wait()
        return not (yield from text.starts(self.format.call_open))

    def _head(self) -> Wait[str | None]:
        """The next call's function, read up to where its arguments begin (None: the generic format's reply)."""
        format_, text = self.format, self.text
        text.space()
        if format_.listed and not self.calls:
            yield from text.expect("[")
            text.space()
        if format_.section and format_.call_open:
            yield from text.expect(format_.call_open)
        if format_.naming == "header":
            header = yield from text.until(format_.header_end)
            name = NAME_END.split(header.removeprefix(format_.header_prefix), maxsplit=1)[0]
        elif format_.naming == "xml":
            text.space()
            yield from text.expect("<function=")
            name = yield from text.until(">")
        else:
            name = yield from self._json_head()
        if name is not None and name not in self.splitter.functions:
            raise NotCall
        return name

    def _json_head(self, name_first: bool = False) -> Wait[str | None]:
        """A JSON call's keys up to its arguments: its name must come first (or, but for `name_first`, after keys
        duo skips, as an id); a name that is not an offered function's ends the reading there."""
        text = self.text
        if self.format.naming == "generic" and not self.calls:
            yield from text.expect("{")
            key = yield from text.json_key()
            if key == "response":
                return None
            if key == "tool_calls":
                text.space()
                yield from text.expect("[")
                self.listed = True
            elif key != "tool_call":
                raise NotCall
        text.space()
        yield from text.expect("{")
        name = None
        while True:
            key = yield from text.json_key()
            if key == self.format.arguments and name is not None:
                return name
            if name_first and name is None and key != self.format.name_key:
                raise NotCall
            value = yield from text.json_value()
            if key == self.format.name_key:
                if not isinstance(value, str) or value not in self.splitter.functions:
                    raise NotCall
                name = value
            text.space()
            yield from text.expect(",")

    def _open(self, name: str) -> None:
        self.text.space()
        self._commit()
        splitter = self.splitter
        self.call = CallOpened(splitter.count, splitter.new_id(), name)
        splitter.count += 1
        self.out.append(self.call)
        self.arguments = []

    def _arguments(self, keyed: bool) -> Wait[None]:
        """The call's arguments, each piece out as it commits, to their end. `keyed`: they are a key's value in a
        JSON call, where a string's text is the arguments (as llama.cpp's parsers' add_tool_call takes it)."""
        assert self.call is not None
        text, xml, scan = self.text, None, None
        if keyed:
            text.space()
            while text.at_end():
                yield from text.wait()  # (which passes the space that arrives meanwhile)
            if text.rest().startswith('"'):
                yield from self._string(self._argued)
                return
        if self.format.naming == "xml":
            xml = XmlArguments(self.splitter.functions[self.call.name])
        else:  # a held call's JSON is checked as it comes: it is text at the first character that breaks it
            scan = JsonCheck() if self.holding else JsonEnd()
        while True:
            rest = text.rest()
            if xml is not None:
                piece, used, done = xml.read(rest, text.final)
            else:
                assert scan is not None
                lead = 0 if scan.started else len(rest) - len(rest.lstrip())  # the space before them is not theirs
                used, done = scan.feed(rest)
                piece = rest[lead:used]
            if piece:
                self._argued(piece)
            text.at += used
            self._commit()
            if done:
                return
            if scan is not None and scan.broken:  # no JSON goes on so: the arguments up to here were said
                raise NotCall
            yield from text.wait()

    def _argued(self, piece: str) -> None:
        assert self.call is not None
        self.arguments.append(piece)
        self.out.append(CallArguments(self.call.index, piece))

    def _object_end(self) -> Wait[None]:
        """A JSON call's keys after its arguments, and its closing brace."""
        text = self.text
        while True:
            text.space()
            if (yield from text.literal("}")):
                return
            yield from text.expect(",")
            yield from text.json_key()
            yield from text.json_value()

    def _tail(self) -> Wait[None]:
        """What closes a call: a JSON call's remaining keys and its brace, the format's call_close."""
        text = self.text
        if self.format.naming in ("json", "generic"):
            yield from self._object_end()
            if self.format.naming == "generic" and not self.listed:
                text.space()
                yield from text.expect("}")
        elif self.format.naming == "xml":
            text.space()
            yield from text.expect("</function>")
        text.space()
        if self.format.call_close:
            yield from text.expect(self.format.call_close)
        self._commit()

    def closed(self, cut: bool = False) -> CallClosed:
        call, self.call = self.call, None
        self.splitter.after_call = True
        assert call is not None
        return CallClosed(call.index, ToolCall(call.id, call.name, "".join(self.arguments)), cut)

    def _commit(self) -> None:
        """What was read is the calls': the buffer keeps what comes after it (a held call's text stays there until
        the call is let out: it is content again if no call)."""
        if self.holding:
            return
        self.splitter.buffer = self.text.cut()
        self.splitter.opener = ""
