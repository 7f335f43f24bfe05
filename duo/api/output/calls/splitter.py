"""Content and where calls open in the streamed text (CallSplitter); duo.api.output.calls.reader reads the calls."""

from __future__ import annotations

import uuid
from typing import Sequence

from duo.api.output.calls.reader import CallReader
from duo.api.output.events import Delta, TextDelta
from duo.api.output.scanning import NotCall, partial_suffix
from duo.api.tools.formats import BARE_CALL, MISTRAL, CallFormat
from duo.api.tools.messages import FunctionBody

PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open its call with it
# The space before a bare call that is the call's, not content (llama.cpp's pattern takes all of it; held back as
# the answer streams, a longer run would be searched again at each piece).
MAX_CALL_SPACE = 64


class CallSplitter:
    """Content and calls of `functions` in `format_` (duo.api.output.events), from the model's text as it streams.

    A call is opened once its function's name is known to be an offered one (as llama-server emits it); its arguments
    follow as their text commits: a JSON format's arguments object as it arrives, Qwen3-Coder's XML parameters as
    JSON built piece by piece. Text that is no call of an offered function, as far as that is known before the call
    opens, stays content, and what follows it is looked through again. Hermes' parser reads calls in other wrappings
    too (duo.api.tools.formats.HERMES_WRAPPINGS: a ```json block, a bare JSON call, <function=NAME>): read here as it
    reads them, but for calls of functions the request did not offer, which stay content. A call that turns out
    malformed after it opened is closed as it stands and marks the answer `broken` (events once sent cannot be taken
    back; a whole answer is then read again as content: see duo.api.output.deltas.whole_answer). A call in another
    wrapping goes out only once whole (duo.api.output.calls.reader.CallReader.holding): malformed, it is content."""

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
        self.plain = False  # the rest of the answer is content (a held call turned out malformed)

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
        if self.plain:
            self.content(out, self.buffer)
            self.buffer = ""
            return False
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
                if reader.holding:  # never went out: its text (the whole of it, still in the buffer) is content, and
                    self.count -= 1  # so is the rest of the answer, as when the whole answer is read (whole_answer)
                    self.plain = True
                else:
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
