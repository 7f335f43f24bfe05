"""The model's text split, as it streams, into content and calls in its template's format (duo.api.events).

A call is opened once its function's name is known to be an offered one (as llama-server emits it); its arguments
follow as their text commits: a JSON format's arguments object as it arrives, Qwen3-Coder's XML parameters as JSON
built piece by piece. Text that is no call of an offered function, as far as that is known before the call opens,
stays content. A call that turns out malformed after it opened is closed as it stands and marks the answer `broken`
(events once sent cannot be taken back; a whole answer is then read again as content: see duo.api.deltas.whole_answer).
"""

from __future__ import annotations

import re
import uuid
from typing import Sequence

from duo.api.events import CallArguments, CallClosed, CallOpened, Delta, TextDelta
from duo.api.tools.formats import MISTRAL, CallFormat
from duo.api.tools.messages import FunctionBody, ToolCall
from duo.api.tools.scanning import JsonEnd, JsonString, More, NotCall, Text, XmlArguments, partial_suffix

PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open its call with it
NAME_END = re.compile(r"[\s:<]")  # after a header's name: Kimi's ":0", GPT-OSS' " <|constrain|>json"


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
        opener = self.format.section or self.format.call_open
        found = [(at, marker) for marker in (opener, *self.format.dropped) if (at := self.buffer.find(marker)) >= 0]
        if not found:
            held = 0 if final else max(partial_suffix(self.buffer, m) for m in (opener, *self.format.dropped))
            self.content(out, self.buffer[:len(self.buffer) - held])
            self.buffer = self.buffer[len(self.buffer) - held:]
            return False
        at, marker = min(found)
        self.content(out, self.buffer[:at])
        self.buffer = self.buffer[at + len(marker):]
        if marker == opener:
            self.opener, self.reading = marker, CallReader(self)
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
        except More:
            if not final:
                return False
            done = self._not_calls(out, reader)
        except NotCall:
            done = self._not_calls(out, reader)
        if done:
            self.reading, self.opener = None, ""
        return done  # not done: the calls wait for more text

    def _not_calls(self, out: list[Delta], reader: CallReader) -> bool:
        """The text read as calls is none after all: content, or, past an opened call, the end of that call."""
        if reader.call is not None:
            self.broken = True
            out.append(reader.closed())
        self.content(out, self.opener + self.buffer)
        self.buffer = ""
        return True

    def content(self, out: list[Delta], text: str) -> None:
        """`text` as content, but for the line breaks between and after calls (the template's layout)."""
        if text and not text.isspace():
            self.started = True
        if text and not (self.count and text.isspace()):
            out.append(TextDelta(text))

    def new_id(self) -> str:
        # Mistral's template refuses call ids that are not 9 letters or digits when they come back.
        return uuid.uuid4().hex[:9] if self.format is MISTRAL else f"call_{uuid.uuid4().hex[:24]}"


class CallReader:
    """The calls after their opening, read as their text commits: each call's head (up to its arguments) whole, its
    arguments in pieces, its tail (up to the next call or the end of the calls) whole."""

    def __init__(self, splitter: CallSplitter) -> None:
        self.splitter = splitter
        self.format = splitter.format
        self.call: CallOpened | None = None  # the call whose arguments are being read
        self.arguments: list[str] = []       # the call's argument pieces so far
        self.argued = False                  # the call's arguments are whole: its tail comes next
        self.calls = 0                       # calls read since the opening
        self.scan: JsonEnd | None = None     # where a JSON format's arguments end
        self.xml: XmlArguments | None = None
        self.listed = self.format.listed      # the generic format's {"tool_calls": [...]} is a list too
        self.reply: JsonString | None = None  # the generic format's {"response": "..."}
        self.replied = False                  # its string has ended

    def read(self, out: list[Delta], final: bool) -> bool:
        """Read what the buffer holds; True once the calls are over. More: wait for text; NotCall: no call."""
        while True:
            text = Text(self.splitter.buffer, final)
            if self.reply is not None:
                return self._reply(out, text)
            if self.call is None:
                if self._over(text):
                    self._commit(text)
                    return True
                name = self._head(text)
                if self.reply is not None:
                    self._commit(text)
                    continue
                self._open(out, name, text)
            elif not self.argued:
                if not self._arguments(out, text):
                    return False
                self.argued = True
            else:
                self._tail(text)
                out.append(self.closed())
                self.calls += 1
                if not (self.listed or self.format.section):
                    return True  # each call has an opening of its own: the splitter finds the next

    def _reply(self, out: list[Delta], text: Text) -> bool:
        """The generic format's {"response": "..."}: the string's text is content, as it streams."""
        assert self.reply is not None
        if not self.replied:
            piece, used, self.replied = self.reply.feed(text.rest())
            if piece:
                self.splitter.content(out, piece)
            text.at += used
            self._commit(text)
            if not self.replied:
                if text.final:
                    raise NotCall
                return False
            text = Text(self.splitter.buffer, text.final)
        text.space()
        text.expect("}")
        self._commit(text)
        return True

    def _over(self, text: Text) -> bool:
        """Whether the calls end here (their section's end, the end of a JSON list, or no further call)."""
        if not self.calls:
            return False
        text.space()
        if self.listed:
            if not text.literal("]"):
                text.expect(",")
                return False
            text.space()
            if self.format.naming == "generic":
                text.expect("}")
            elif self.format.section_end:
                text.literal(self.format.section_end)
            return True
        if self.format.section_end and text.literal(self.format.section_end):
            return True
        if text.at_end():
            raise More
        return not text.starts(self.format.call_open)

    def _head(self, text: Text) -> str:
        """The next call's function, read up to where its arguments begin."""
        format_ = self.format
        text.space()
        if format_.listed and not self.calls:
            text.expect("[")
            text.space()
        if format_.section and format_.call_open:
            text.expect(format_.call_open)
        if format_.naming == "header":
            header = text.until(format_.header_end)
            name = NAME_END.split(header.removeprefix(format_.header_prefix), maxsplit=1)[0]
        elif format_.naming == "xml":
            text.space()
            text.expect("<function=")
            name = text.until(">")
        else:
            name = self._json_head(text)
        if name not in self.splitter.functions and self.reply is None:
            raise NotCall
        return name

    def _json_head(self, text: Text) -> str:
        """A JSON call's keys up to its arguments: its name must come first (or after keys duo skips, as an id)."""
        if self.format.naming == "generic" and not self.calls:
            text.expect("{")
            key = text.json_key()
            if key == "response":
                self.reply = JsonString()
                return ""
            if key == "tool_calls":
                text.space()
                text.expect("[")
                self.listed = True
            elif key != "tool_call":
                raise NotCall
        text.space()
        text.expect("{")
        name = None
        while True:
            key = text.json_key()
            if key == self.format.arguments and name is not None:
                return name
            value = text.json_value()
            if key == self.format.name_key and isinstance(value, str):
                name = value
            text.space()
            text.expect(",")

    def _open(self, out: list[Delta], name: str, text: Text) -> None:
        text.space()
        self._commit(text)
        splitter = self.splitter
        self.call = CallOpened(splitter.count, splitter.new_id(), name)
        splitter.count += 1
        out.append(self.call)
        self.arguments = []
        if self.format.naming == "xml":
            self.xml = XmlArguments(splitter.functions[name])
        else:
            self.scan = JsonEnd()

    def _arguments(self, out: list[Delta], text: Text) -> bool:
        """The arguments the buffer adds (True once they are whole)."""
        if self.xml is not None:
            piece, used, done = self.xml.read(text.rest(), text.final)
        else:
            assert self.scan is not None
            rest = text.rest()
            lead = 0 if self.scan.started else len(rest) - len(rest.lstrip())  # the space before them is not theirs
            used, done = self.scan.feed(rest)
            piece = rest[lead:used]
        if piece:
            self.arguments.append(piece)
            out.append(CallArguments(self.call.index, piece))
        self.splitter.buffer = self.splitter.buffer[used:]
        if not done and text.final:
            raise NotCall
        return done

    def _tail(self, text: Text) -> None:
        """What closes a call: a JSON call's remaining keys and its brace, the format's call_close."""
        if self.format.naming in ("json", "generic"):
            while True:
                text.space()
                if text.literal("}"):
                    break
                text.expect(",")
                text.json_key()
                text.json_value()
            if self.format.naming == "generic" and not self.listed:
                text.space()
                text.expect("}")
        elif self.format.naming == "xml":
            text.space()
            text.expect("</function>")
        text.space()
        if self.format.call_close:
            text.expect(self.format.call_close)
        self._commit(text)

    def closed(self) -> CallClosed:
        call, self.call, self.scan, self.xml, self.argued = self.call, None, None, None, False
        assert call is not None
        return CallClosed(call.index, ToolCall(call.id, call.name, "".join(self.arguments)))

    def _commit(self, text: Text) -> None:
        self.splitter.buffer = self.splitter.buffer[text.at:]
        self.splitter.opener = ""
