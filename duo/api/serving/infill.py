"""Fill-in-the-middle: llama-server's /infill prompt from the model's own FIM tokens, and its stop rules.

The prompt is laid out as llama-server lays it (Qwen2.5-Coder's repository-level pattern, arXiv 2409.12186):

    <|repo_name|>myproject\\n<|file_sep|>{filename}\\n{text} ... <|file_sep|>filename\\n
    <|fim_prefix|>{input_prefix}{prompt}<|fim_suffix|>{input_suffix}<|fim_middle|>

with the same budgets: the prefix keeps its last 3/4 of a batch of tokens, the suffix its first 1/4 (less the
prompt), the extra chunks what the context has left after a batch and twice the tokens to predict (their last
tokens). A model without FIM tokens gets a 400; one without repository tokens gets the chunks under a plain
separator, as llama-server does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from duo.api.serving.stop import StopMatcher
from duo.llama.model import Model

FIM_BATCH = 2048  # llama-server's default --batch-size, which sets its FIM budgets (capped by the context)
REPO_NAME = "myproject\n"  # llama-server's: the project has no name in the request
CURRENT_FILE = "filename\n"  # likewise for the file being edited
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra chunks, for models without <|file_sep|>


class NoFim(ValueError):
    """The model has no fill-in-the-middle tokens."""


@dataclass(frozen=True)
class FimInput:
    """What surrounds the hole: text before it (`prompt` continues the prefix: the cursor's line so far), after it,
    and other files' chunks (filename, text) for context."""

    prefix: str
    suffix: str
    extra: tuple[tuple[str, str], ...] = ()
    prompt: str | tuple[int, ...] = ""


def fim_tokens(model: Model, fim: FimInput, n_ctx: int, n_predict: int) -> list[int]:
    """The prompt of `fim` for `model` (see the module); NoFim naming what the model lacks."""
    pre, suf, mid = (model.special_token(name) for name in ("fim_pre", "fim_suf", "fim_mid"))
    missing = [what for what, token in [("prefix", pre), ("suffix", suf), ("middle", mid)] if token is None]
    if missing:
        raise NoFim(f"infill is not supported by {model.path.name}: it has no fill-in-the-middle "
                    f"{', '.join(missing)} token; use a FIM-trained model (`duo models` says which are)")

    def text(value: str) -> list[int]:  # the client's text stays text: control-token spellings are not parsed
        return model.tokenize(value, add_special=False, parse_special=False)

    prompt = list(fim.prompt) if isinstance(fim.prompt, tuple) else model.tokenize(fim.prompt, add_special=False)
    # llama-server's batch, but at most half the context: its budgets assume a context far larger than a batch (its
    # default is the model's whole training context), and a prompt that cannot fit would only be refused.
    n_batch = min(FIM_BATCH, n_ctx // 2)
    prefix, suffix = text(fim.prefix), text(fim.suffix)
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (n_batch // 4)):]
    suffix = suffix[:max(0, n_batch // 4 - (2 + len(prompt)))]
    bos = [model.special_token("bos")] if model.vocab().add_bos and model.special_token("bos") is not None else []
    core = bos + [pre, *prefix, *prompt, suf, *suffix, mid]
    # The chunks get what is left after a batch and twice the tokens to predict, and never the room the answer needs.
    budget = min(max(0, n_ctx - n_batch - 2 * (n_predict or -1)), max(0, n_ctx - len(core) - max(n_predict, 1)))
    extra = _extra_tokens(model, fim.extra, text, budget)
    return extra[len(extra) - min(budget, len(extra)):] + core


def _extra_tokens(model: Model, chunks: tuple[tuple[str, str], ...], text: Callable[[str], list[int]],
                  budget: int) -> list[int]:
    """The chunks under the repository's name, each under its file's, then the current file's separator; of which
    the caller keeps the last `budget` tokens, so the chunks are tokenized from the last one back until they fill it
    (an editor may send hundreds of chunks; those that cannot fit cost nothing)."""
    rep, sep = model.special_token("fim_rep"), model.special_token("fim_sep")
    tail = [sep, *text(CURRENT_FILE)] if sep is not None else []
    pieces: list[list[int]] = [tail]
    held = len(tail)
    for filename, chunk in reversed(chunks):
        if held >= budget:
            break
        head = [sep, *text(filename + "\n")] if sep is not None else text(SNIPPET_SEPARATOR)
        pieces.append(head + text(chunk))
        held += len(pieces[-1])
    else:  # every chunk fits: the repository's name opens them
        pieces.append([rep, *text(REPO_NAME)] if rep is not None else [])
    return [token for piece in reversed(pieces) for token in piece]


def stops_for(stop: list[str] | tuple[str, ...], n_indent: int, t_max_predict_ms: int,
              fim: FimInput | None) -> StopMatcher | FimStops:
    """The stop strings, with the code-completion rules where the request has any of them."""
    if fim is None and n_indent <= 0 and t_max_predict_ms <= 0:
        return StopMatcher(stop)
    return FimStops(StopMatcher(stop), n_indent, t_max_predict_ms, fim.suffix if fim else "")


class FimStops:
    """Stop strings, then the rules llama-server applies to code completion, over the text as it grows; the
    interface of StopMatcher (feed, flush), and `why` the completion stopped as llama-server's stop_type says it.

    - n_indent: a line after the first that starts less indented than this (an empty one too) ends the completion
      before its first character (the suggestion stays inside the block the cursor is in).
    - t_max_predict_ms: past this time since the first token, the completion ends at the next line break.
    - The suffix: a line after the first that repeats the suffix's next non-blank line means the hole is filled and
      the model is writing what follows it: the completion ends before that line (editors drop such repeats too).
    Text that one of them may still cut (a line's indentation, a line that may become the suffix's) is held back.
    """

    def __init__(self, stops: StopMatcher, n_indent: int = 0, t_max_predict_ms: int = 0, suffix: str = "") -> None:
        self.stops = stops
        self.n_indent = n_indent
        self.time_limit_s = t_max_predict_ms / 1000 if t_max_predict_ms > 0 else None
        self.next_line = next((line.rstrip() for line in suffix.split("\n")[1:] if line.strip()), "")
        self.text = ""  # what the stop strings let through
        self.shown = 0  # how much of it was returned
        self.checked = 0  # where the first line not yet passed by the rules starts (0: before the first break)
        self.started: float | None = None
        self.why = "word"

    @property
    def word(self) -> str:
        """The stop string that ended the completion ("" where a code-completion rule did)."""
        return self.stops.word

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.started is None:
            self.started = time.monotonic()
        out, stopped = self.stops.feed(piece)
        if not stopped and self._timed_out(out):
            out, stopped, self.why = out + self.stops.flush(), True, "limit"
        return self._advance(out, final=stopped)

    def flush(self) -> str:
        return self._advance(self.stops.flush(), final=True)[0]

    def _timed_out(self, new_text: str) -> bool:
        """Past the time limit, upon a line break (llama-server's rule: the completion ends with a whole line)."""
        return (self.time_limit_s is not None and "\n" in new_text
                and time.monotonic() - (self.started or 0.0) > self.time_limit_s)

    def _advance(self, out: str, final: bool) -> tuple[str, bool]:
        self.text += out
        cut = self._cut(final)
        end = cut if cut is not None else len(self.text) if final else self._safe_end()
        shown, self.shown = self.text[self.shown:end], max(self.shown, end)
        return shown, final or cut is not None

    def _cut(self, final: bool) -> int | None:
        """Where a rule ends the text, from the lines after the first (the first continues the cursor's line); the
        lines already passed are not read again."""
        start = self.checked or self.text.find("\n") + 1
        while start:
            self.checked = start
            end = self.text.find("\n", start)
            line = self.text[start:] if end < 0 else self.text[start:end]
            body = line.lstrip(" \t")
            # An empty line ends it too, as in llama-server (what follows the indentation is the line break).
            if self.n_indent and (body or end >= 0) and len(line) - len(body) < self.n_indent:
                self.why = "limit"
                return start + len(line) - len(body)
            if self.next_line and (end >= 0 or final) and line.rstrip() == self.next_line:
                self.why = "word"
                return start
            start = end + 1
        return None

    def _safe_end(self) -> int:
        """The end of what no rule can cut any more: all but a last line that may still become a cut one."""
        start = self.text.rfind("\n") + 1
        if not start:
            return len(self.text)
        line = self.text[start:]
        may_cut = (self.n_indent and not line.strip(" \t")) or (self.next_line and
                                                                  self.next_line.startswith(line.rstrip()))
        return start if may_cut else len(self.text)
