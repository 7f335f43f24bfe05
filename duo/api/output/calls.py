"""The model's text split, as it streams, into content and calls in its template's format (duo.api.output.events).

A call is opened once its function's name is known to be an offered one (as llama-server emits it); its arguments
follow as their text commits: a JSON format's arguments object as it arrives, Qwen3-Coder's XML parameters as JSON
built piece by piece. Text that is no call of an offered function, as far as that is known before the call opens,
stays content, and what follows it is looked through again. Hermes' parser reads calls in other wrappings too
(duo.api.tools.formats.HERMES_WRAPPINGS: a ```json block, a bare JSON call, <function=NAME>): read here as it reads
them, but for calls of functions the request did not offer, which stay content. A call that turns out malformed
after it opened is closed as it stands and marks the answer `broken`
(events once sent cannot be taken back; a whole answer is then read again as content: see duo.api.output.deltas.whole_answer).
"""

from __future__ import annotations

import re
import uuid
from typing import Callable, Sequence

from duo.api.output.events import CallArguments, CallClosed, CallOpened, Delta, TextDelta
from duo.api.tools.formats import BARE_CALL, FENCE, FUNCTION_HEADERS, JSON_TAGS, MISTRAL, CallFormat
from duo.api.tools.messages import FunctionBody, ToolCall
from duo.api.output.scanning import JsonEnd, JsonString, NotCall, Text, Wait, XmlArguments, partial_suffix

PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open its call with it
NAME_END = re.compile(r"[\s:<]")  # after a header's name: Kimi's ":0", GPT-OSS' " <|constrain|>json"
# The space before a bare call that is the call's, not content (llama.cpp's pattern takes all of it; held back as
# the answer streams, a longer run would be searched again at each piece).
MAX_CALL_SPACE = 64


class CallSplitter:
    """Content and calls of `functions` in `format_`, from the model's text as it streams."""

    def __init__(self, functions: Sequence[FunctionBody], format_: CallFormat) -> None:
        self.functions = {function.name: function for function in functions}
        self.format = format_
        self.buffer = ""
        self.opener = ""    # what opened the calls being read, content again if they turn out to be none
        self.reading: CallReader | None = None
        self.count = 0      # calls opened
        self.started = False  # content went out (an at_start format then has no call)
        self.broken = False   # a call turned out malformed after it was opened
        self.after_call = False  # a call closed and no content came since (the space after a call is not content)

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        """What is left at the end of the answer."""
        return self._run(final=True)

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        # At the end, calls being read are read to their end even with no text left (cut off: not a call after all).
        while (self.buffer or final and self.reading) and (
                self._read_calls(out, final) if self.reading else self._find_calls(out, final)):
            pass
        return out

    def _find_calls(self, out: list[Delta], final: bool) -> bool:
        """Content up to where calls open (True: they do), or up to what may still become their opening."""
        if self.format.at_start:
            return self._find_bare_calls(out, final)
        openers = self.format.openers
        markers = (*openers, *self.format.dropped)
        found = [(at, marker) for marker in markers if (at := self.buffer.find(marker)) >= 0]
        if not found:
            held = 0 if final else max(partial_suffix(self.buffer, m) for m in markers)
            if BARE_CALL in openers and not final:  # the space before a brace: a bare call's, if one follows
                held = max(held, min(len(self.buffer) - len(self.buffer.rstrip()), MAX_CALL_SPACE))
            self.content(out, self.buffer[:len(self.buffer) - held])
            self.buffer = self.buffer[len(self.buffer) - held:]
            return False
        at, marker = min(found)
        if marker not in openers:  # the template's markup around content: not content
            self.content(out, self.buffer[:at])
            self.buffer = self.buffer[at + len(marker):]
            return True
        start, read_from = at, at + len(marker)
        if marker == BARE_CALL:  # llama.cpp's pattern (\s*\{\s*"name") takes the space before it; the brace is read
            start, read_from = max(len(self.buffer[:at].rstrip()), at - MAX_CALL_SPACE), at
        self.content(out, self.buffer[:start])
        self.opener, self.buffer = self.buffer[start:read_from], self.buffer[read_from:]
        self.reading = CallReader(self, "" if marker == openers[0] else marker)
        return True

    def _find_bare_calls(self, out: list[Delta], final: bool) -> bool:
        """Llama 3.x and the generic format: the answer is one JSON object (after Llama's <|python_tag|>) or text."""
        head = self.buffer.lstrip()
        body = head[len(PYTHON_TAG):].lstrip() if head.startswith(PYTHON_TAG) else head
        if not self.started and not final and (not body or PYTHON_TAG.startswith(head)):
            return False  # maybe the start of a call: wait for more
        if self.started or not body.startswith("{"):
            self.content(out, self.buffer)
            self.buffer = ""
            return False
        self.opener, self.buffer = self.buffer[:len(self.buffer) - len(body)], body
        self.reading = CallReader(self)
        return True

    def _read_calls(self, out: list[Delta], final: bool) -> bool:
        reader = self.reading
        assert reader is not None
        try:
            done = reader.read(out, final)
        except NotCall:
            done = self._not_calls(out, reader)
        if done:
            self.reading, self.opener = None, ""
        return done  # not done: the calls wait for more text

    def _not_calls(self, out: list[Delta], reader: CallReader) -> bool:
        """The text read as calls is none after all. Past an opened call: the end of that call, and the rest is
        content. Before: its opening is content, and the text after the opening is looked through again (a call
        may open further on: a brace in a sentence is no call, a ```json block after it may be)."""
        if reader.call is not None or self.format.at_start:  # (an at_start format's answer is then content)
            if reader.call is not None:
                self.broken = True
                out.append(reader.closed(cut=True))
            self.content(out, self.opener + self.buffer)
            self.buffer = ""
            return True
        kept = len(BARE_CALL) if reader.wrapping == BARE_CALL else 0  # a bare call's brace is still in the buffer
        self.content(out, self.opener + self.buffer[:kept])
        self.buffer = self.buffer[kept:]
        return True

    def content(self, out: list[Delta], text: str) -> None:
        """`text` as content, but for the space after a call (the template's layout; llama.cpp's parsers pass it)."""
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        if text and not text.isspace():
            self.started = True
        if text:
            out.append(TextDelta(text))

    def new_id(self) -> str:
        # Mistral's template refuses call ids that are not 9 letters or digits when they come back.
        return uuid.uuid4().hex[:9] if self.format is MISTRAL else f"call_{uuid.uuid4().hex[:24]}"


class CallReader:
    """The calls after their opening, read as their text commits: each call's head (up to its arguments) whole, its
    arguments in pieces, its tail (up to the next call or the end of the calls) whole. The reading is one coroutine
    (`steps`) that waits where the text runs out and goes on from there as more arrives: a head or a tail cut into
    many pieces is read once, not again from its start at each piece."""

    def __init__(self, splitter: CallSplitter, wrapping: str = "") -> None:
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

    def read(self, out: list[Delta], final: bool) -> bool:
        """Read what the buffer holds: True once the calls are over, False while they wait for more text; NotCall
        where they turn out to be none."""
        self.out = out
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
        self._commit()
        self.out.append(self.closed())

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
        else:
            scan = JsonEnd()
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
        """What was read is the calls': the buffer keeps what comes after it."""
        self.splitter.buffer = self.text.cut()
        self.splitter.opener = ""
