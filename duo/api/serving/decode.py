"""Where an answer's text came from, character by character: the sources of the target's steps (duo.target.request:
draft, grammar, lookup, target) carried to the text a stream releases, for the `duo_sources` stream extension.

Text leaves the tokens in three stages, and each keeps the characters' sources beside their text: the UTF-8 decoder
(a character split across tokens takes the source of the token that completes it), the stop strings (what they hold
back keeps its sources until it is released or cut: released text is always the start of what they were fed), and
the answer's shape (duo.api.output.deltas: content, reasoning and calls' arguments are pieces of the model's text, in order,
between markup it drops).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from itertools import groupby

from duo.api.serving.chat_tokens import Tokenizer, answer_text
from duo.target.request import TARGET, Step

Runs = list[list[str]]  # [[text, source], ...]: neighbouring characters of one source as one text


class SourcedDecoder:
    """Steps' tokens to text, as one incremental UTF-8 decoder gives it, each character with its token's source;
    the characters decoded but not yet released (held back by stop strings) keep theirs until `release`."""

    def __init__(self, model: Tokenizer, preserved: frozenset[int]) -> None:
        self.model = model
        self.preserved = preserved  # control tokens the answer spells out (duo.api.serving.chat_tokens.answer_text)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending: list[str] = []  # the source of each character decoded and not yet released
        self.last = TARGET  # the latest token's source: what bytes left over at the end are told

    def decode(self, step: Step, final: bool) -> str:
        """The text `step` completes (all of what is left where `final`), its characters' sources kept pending.
        Token by token: the same text as the step's bytes decoded at once (answer_text joins the tokens' bytes)."""
        text = []
        for token, source in zip(step.tokens, step_sources(step)):
            self.last = source
            text.append(self._decoded(answer_text(self.model, [token], self.preserved), final=False))
        if final:
            text.append(self._decoded(b"", final=True))
        return "".join(text)

    def _decoded(self, data: bytes, final: bool) -> str:
        chars = self.decoder.decode(data, final=final)
        self.pending += [self.last] * len(chars)
        return chars

    def release(self, n_chars: int) -> tuple[str, ...]:
        """The sources of the next `n_chars` characters released (the stop strings let them out)."""
        released, self.pending = self.pending[:n_chars], self.pending[n_chars:]
        return tuple(released)


def step_sources(step: Step) -> tuple[str, ...]:
    """The source of each of the step's tokens; a step that tells none (one made outside Generation.commit) is
    counted as the target's own."""
    return step.sources or (TARGET,) * len(step.tokens)


class SourceAligner:
    """An answer's shown texts (its content, reasoning and calls' arguments, in the order they are shown) as runs
    of one source, found in the model's text as it is released. Markup the answer drops (reasoning tags, a call's
    syntax, stripped spaces) is skipped; text the answer writes itself (a tag deepseek-legacy puts back, arguments
    written anew) is not in the model's text and takes the source of the text that comes next."""

    def __init__(self) -> None:
        self.text = ""  # the model's released text not yet shown (or skipped)
        self.sources: list[str] = []  # the source of each of its characters

    def feed(self, text: str, sources: Sequence[str]) -> None:
        self.text += text
        self.sources += sources

    def runs(self, shown: str) -> Runs:
        """`shown`'s runs (they concatenate to it), the model's text up to its end consumed."""
        at = self.text.find(shown) if shown else -1
        if at < 0:
            return runs(shown, [self.sources[0] if self.sources else TARGET] * len(shown))
        end = at + len(shown)
        sources, self.text, self.sources = self.sources[at:end], self.text[end:], self.sources[end:]
        return runs(shown, sources)


def runs(text: str, sources: Sequence[str]) -> Runs:
    """`text` (one source per character) cut where the source changes: [[piece, source], ...]."""
    cut: Runs = []
    at = 0
    for source, group in groupby(sources):
        end = at + len(list(group))
        cut.append([text[at:end], source])
        at = end
    return cut
