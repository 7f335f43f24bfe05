"""Stop strings: cut a stream of text pieces where one of them first appears, holding back what may start one."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed it the completion's text piece by piece; it returns what is safe to show.

    A stop string can span pieces, so the longest tail of the text seen so far that is the start of
    some stop string is held back until the next piece settles it. Example with stop ["\\n\\n"]:
    feed("a\\n") -> ("a", False) holds "\\n"; feed("b") -> ("\\nb", False); feed("\\n\\nc") ->
    ("", True): the text ends before the stop string, which is not returned.
    """

    why = "word"  # what stopped it, as llama-server's stop_type says: a stop string

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.held = ""
        self.stopped = False
        self.word = ""  # the stop string that ended the completion (llama-server's stopping_word)

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string ended the completion)."""
        if self.stopped:
            return "", True
        text = self.held + piece
        end = self._first_stop(text)
        if end is not None:
            self.held, self.stopped = "", True
            return text[:end], True
        keep = self._held_back_length(text)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, once the completion ended without reaching a stop string."""
        text, self.held = self.held, ""
        return text

    def _first_stop(self, text: str) -> int | None:
        """Where the first stop string starts (the shortest of those starting there: it completes first)."""
        found = [(at, len(stop), stop) for stop in self.stops if (at := text.find(stop)) >= 0]
        if not found:
            return None
        at, _, self.word = min(found)
        return at

    def _held_back_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
