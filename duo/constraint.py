"""Constrained decoding: a grammar (a JSON schema, GBNF, Lark, a regex) as a mask over the vocabulary at each
position, through llguidance (the engine of llama.cpp's LLAMA_LLGUIDANCE, vLLM and SGLang).

Masking is exact under speculation as long as every position's distribution is masked with the matcher in the
state that position sees: the committed tokens and the drafts before it. The target masks the rows it verifies
(p becomes the constrained target distribution, so greedy and both stochastic verifications stay exact); the
draft masks what it drafts from (q, so that its drafts stay inside the grammar and are accepted). A Cursor
follows one token sequence at a time and moves to another by rolling back to their common prefix, which is
how a chain is walked and then taken back to what was committed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

import llguidance
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from duo.llama.context import common_prefix_length

# What one grammar may cost to compile and to mask a position (llguidance's own limits, lowered where its
# defaults allow hundreds of MB): a hostile schema fails with an error instead of stalling or filling memory.
# Fuel: ~50k units per ms to build the lexer, ~14k per ms per mask step; a lexer state costs 1-2 kB.
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=50_000, max_grammar_size=200_000)
KINDS = ("json_schema", "gbnf", "lark", "regex")
# What a grammar may cost beyond llguidance's limits, which bound neither compiling (a schema of N optional properties
# compiles in ~0.05 (N / 1000)^2 s on a Xeon core) nor the lexer states one mask may build (`/(x{1000}){1000}/`:
# 0.3-0.8 s a mask, and 62k forced tokens computed with the GIL held for 0.3 s). Compiling, the first mask and the
# first forced text together get COMPILE_BUDGET_S; a later mask gets MASK_BUDGET_S, past which its request ends.
COMPILE_BUDGET_S = 2.0
MASK_BUDGET_S = 0.25
MAX_FORCED_TOKENS = 1024  # a grammar that forces more from its start is refused; later forced text is cut to this
# llguidance tokenizes forced text with the GIL held (62k tokens: 0.3 s with every thread stopped): past this many
# forced bytes none are proposed (the masks lead the way), and a grammar forcing that many from its start is refused.
MAX_FORCED_BYTES = 8 * MAX_FORCED_TOKENS
# Compiles running at once, those whose clients were answered (past the budget: a thread cannot be stopped) included.
MAX_COMPILING = 4
# JSON's whitespace between tokens, as llama.cpp's json-schema-to-grammar allows it: none, one space, or a line
# break and up to 20 spaces or tabs of indentation. Unbounded whitespace (llguidance's default) lets a model that
# hesitates fill its whole answer with blank lines, which small models do.
JSON_OPTIONS = {"whitespace_pattern": r"(?: |\n[ \t]{0,20})?"}


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar as the client sent it: `kind` one of duo.constraint.KINDS; `param` the field that held it, named
    in errors."""

    kind: str
    source: str | dict[str, Any]
    param: str


class GrammarError(ValueError):
    """A grammar or schema that cannot be compiled; the message says what is wrong with it."""


class GrammarTooCostly(GrammarError):
    """A grammar that compiles but costs more than its budget to compile or to mask a position."""


class CompilerBusy(Exception):
    """MAX_COMPILING grammars are compiling already; the client should retry later."""


class VocabModel(Protocol):
    """What a tokenizer for grammars is built from (duo.llama.model.Model)."""

    n_vocab: int

    def llama_vocab(self) -> Any: ...
    def end_of_generation_ids(self) -> list[int]: ...


def grammar_of(kind: str, source: str | dict[str, Any]) -> str:
    """llguidance's grammar (a JSON string) for `source` of `kind` (one of KINDS); GrammarError when the source
    is not even of that kind (a schema that is not JSON). Whether it compiles, Cursor.compile says."""
    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}")
    try:
        if kind == "json_schema":
            schema = json.loads(source) if isinstance(source, str) else source
            if not isinstance(schema, dict):
                raise GrammarError(f"a JSON schema is a JSON object, not {type(schema).__name__}")
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        return llguidance.grammar_from(kind, source)
    except (ValueError, TypeError) as error:
        raise GrammarError(f"not a valid {kind.replace('_', ' ')}: {error}") from None


_tokenizers: weakref.WeakKeyDictionary[Any, LLTokenizer] = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def tokenizer_for(model: VocabModel) -> LLTokenizer:
    """The model's vocabulary as llguidance reads it, every end-of-generation id ending a grammar; built once
    per model (~1.5 s for 152k tokens), on whichever thread first asks."""
    with _tokenizers_lock:
        if model not in _tokenizers:
            # Imported here: it imports llama_cpp, which `duo-target --help` must not need (tests/house/test_builds.py).
            from llguidance.llamacpp import lltokenizer_from_vocab
            with warnings.catch_warnings():  # it asks llama.cpp for each token's attributes by a deprecated name
                warnings.simplefilter("ignore", DeprecationWarning)
                _tokenizers[model] = lltokenizer_from_vocab(model.llama_vocab(), n_vocab=model.n_vocab,
                                                            eos_token=model.end_of_generation_ids())
        return _tokenizers[model]


def build_tokenizer_in_background(model: VocabModel) -> None:
    """Start building the model's vocabulary for grammars (tokenizer_for) on a thread of its own, as the process
    starts: its last step holds the GIL for ~0.6 s (llguidance's, 152k tokens), which the process then pays once
    before it has much to do, not in the middle of serving the first grammar. duo-target waits for it before it
    serves; duo-draft drafts at once (a draft restarted after a crash), a grammar that comes meanwhile waiting for the
    build in tokenizer_for."""
    threading.Thread(target=tokenizer_for, args=(model,), name="duo-grammar-vocabulary", daemon=True).start()


class Cursor:
    """An llguidance matcher walking the constrained part of one sequence (the tokens after the prompt).

    `tokens` is where it stands. move_to(other) rolls back to the common prefix and consumes the rest, so
    walking a chain and coming back to the committed tokens costs one consume and one rollback per token.
    Not thread-safe: one owner at a time (the target's model thread verifies, its event loop commits, never at
    once for one request).
    """

    def __init__(self, matcher: LLMatcher, n_vocab: int, ends: frozenset[int]) -> None:
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.ends = ends  # the end-of-generation ids, allowed where the grammar is complete
        self.tokens: list[int] = []

    @classmethod
    def compile(cls, model: VocabModel, grammar: str) -> "Cursor":
        """A cursor at the start of `grammar` for `model`'s vocabulary, or GrammarError saying why it cannot be.
        Compiling can take up to ~100 ms for a large schema (bounded by LIMITS): call it off the event loop."""
        tokenizer = tokenizer_for(model)
        matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=LLParserLimits(**LIMITS))
        if matcher.is_error():
            raise GrammarError(_first_lines(matcher.get_error()))
        return cls(matcher, model.n_vocab, frozenset(tokenizer.eos_tokens))

    def copy(self) -> "Cursor":
        twin = Cursor(self.matcher.deep_copy(), self.n_vocab, self.ends)
        twin.tokens = list(self.tokens)
        return twin

    def move_to(self, tokens: Sequence[int]) -> bool:
        """Stand after `tokens`; False where the grammar forbids one of them (the cursor then stands after the
        longest allowed prefix)."""
        keep = common_prefix_length(self.tokens, tokens)
        if keep < len(self.tokens):
            if not self.matcher.rollback(len(self.tokens) - keep):
                raise GrammarError(_first_lines(self.matcher.get_error()) or "the grammar could not roll back")
            del self.tokens[keep:]
        rest = list(tokens[keep:])
        if not rest:
            return True
        taken = self.matcher.try_consume_tokens(rest)
        self.tokens += rest[:taken]
        if self.matcher.is_error():  # never for try_consume_tokens, but a matcher in error stays so
            raise GrammarError(_first_lines(self.matcher.get_error()))
        return taken == len(rest)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, following where the cursor stands, the grammar allows (the cursor stays)."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def allowed(self, budget_s: float = MASK_BUDGET_S) -> np.ndarray:
        """Which token ids may come next, as a bool array over the model's vocabulary; GrammarTooCostly where
        computing it took longer than `budget_s` (it runs on a model thread every session shares)."""
        began = time.perf_counter()
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if (spent := time.perf_counter() - began) > budget_s:
            raise GrammarTooCostly(f"the grammar took {spent:.2f} s to mask one position (at most {budget_s:g} s): "
                                   "simplify it (a regex repeating a repetition costs the most)")
        allowed = np.unpackbits(bits, bitorder="little")[:self.n_vocab].astype(bool)
        if allowed.size < self.n_vocab:  # ids past the tokenizer's vocabulary: never allowed
            allowed = np.concatenate([allowed, np.zeros(self.n_vocab - allowed.size, dtype=bool)])
        return allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` (one row, changed in place and returned) with every token the grammar forbids here at -inf:
        softmax gives them probability 0, so any distribution duo.sampling makes of the row is the constrained one."""
        logits[~self.allowed()] = -np.inf
        return logits

    def masks_after(self, base: Sequence[int], drafts: Sequence[int]) -> list[np.ndarray]:
        """The masks of verification rows 1..len(drafts): row i holds the distribution after base + drafts[:i] (a
        chain being verified after the committed tokens), so it is masked with the cursor there. Every draft must be
        allowed (the caller cut the chain at its first forbidden token); rows past a drafted end of generation get
        none: nothing after it is ever committed. The cursor ends at `base` again."""
        masks = []
        for i in range(1, len(drafts) + 1):
            if drafts[i - 1] in self.ends:
                break
            if not self.move_to([*base, *drafts[:i]]):
                raise GrammarError(f"draft token {drafts[i - 1]} is not allowed here: the chain was not cut")
            masks.append(self.allowed())
        self.move_to(base)
        return masks

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here whatever the model says (`{"name": "` of a schema), at most
        MAX_FORCED_TOKENS of them. Call it off the event loop: it may build lexer states with the GIL held."""
        if len(self.matcher.compute_ff_bytes()) > MAX_FORCED_BYTES:
            return []
        return list(self.matcher.compute_ff_tokens()[:MAX_FORCED_TOKENS])


def checked_cursor(model: VocabModel, grammar: str, budget_s: float = COMPILE_BUDGET_S) -> Cursor:
    """Cursor.compile, then the masks and forced text of the positions every output reaches (the start, and the end
    of each forced run: the model has no say before it), computed once: a grammar can compile in a millisecond and
    take seconds to build the lexer states those positions need (`/(x{1000}){1000}/`, or a schema's string pattern
    behind a forced `{"a": "`). GrammarTooCostly where it all took longer than `budget_s`, or where the grammar
    forces more than MAX_FORCED_TOKENS from its start. The cursor is returned at the start."""
    began = time.perf_counter()
    cursor = Cursor.compile(model, grammar)
    walked: list[int] = []
    while True:
        cursor.allowed(budget_s=budget_s)  # the mask first: it builds the states without the GIL, then forced() needs none
        if len(walked) + len(cursor.matcher.compute_ff_bytes()) > MAX_FORCED_BYTES:
            raise GrammarTooCostly(f"it forces more than {MAX_FORCED_BYTES} bytes from its start")
        forced = cursor.matcher.compute_ff_tokens()
        walked += forced
        if (spent := time.perf_counter() - began) > budget_s:
            raise GrammarTooCostly(f"compiling it took {spent:.2f} s (at most {budget_s:g} s): simplify it")
        if len(walked) > MAX_FORCED_TOKENS:
            raise GrammarTooCostly(f"it forces more than {MAX_FORCED_TOKENS} tokens from its start")
        if not forced or not cursor.move_to(walked):
            break
    cursor.move_to([])
    return cursor


class Compiler:
    """Compiles grammars on threads of their own, each within a budget: a caller waits COMPILE_BUDGET_S at most and
    then gets GrammarTooCostly, so no client's grammar holds a running place, an executor thread the others need, or
    another session's events for longer. A compile past its budget runs on to its end (llguidance cannot be
    interrupted) and counts against MAX_COMPILING until then; beyond that many, CompilerBusy."""

    def __init__(self, budget_s: float = COMPILE_BUDGET_S, most: int = MAX_COMPILING) -> None:
        self.budget_s = budget_s
        self.most = most
        self.running = 0

    async def compile(self, model: VocabModel, grammar: str) -> Cursor:
        if self.running >= self.most:
            raise CompilerBusy(f"{self.running} grammars are compiling; retry in a few seconds")
        # The vocabulary is built once per process, from its start (build_tokenizer_in_background: seconds on a
        # loaded core): waiting for it is the process starting, not this grammar's cost, so it is not budgeted.
        await asyncio.to_thread(tokenizer_for, model)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Cursor] = loop.create_future()
        self.running += 1

        def work() -> None:
            try:
                outcome: Cursor | BaseException = checked_cursor(model, grammar, self.budget_s)
            except BaseException as error:  # noqa: BLE001 - handed to the waiting coroutine, which raises it
                outcome = error
            try:
                loop.call_soon_threadsafe(self._finished, done, outcome)
            except RuntimeError:  # the loop has closed (the process stops): nobody is left to tell
                pass

        threading.Thread(target=work, name="duo-grammar", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(done), self.budget_s)
        except asyncio.TimeoutError:
            raise GrammarTooCostly(f"compiling it takes longer than {self.budget_s:g} s: simplify it") from None
        finally:
            done.cancel()  # answered, timed out or left: what the thread ends with goes to nobody

    def _finished(self, done: asyncio.Future[Cursor], outcome: Cursor | BaseException) -> None:
        self.running -= 1
        if done.done():
            return  # its caller was answered already (past the budget) or has left
        if isinstance(outcome, BaseException):
            done.set_exception(outcome)
        else:
            done.set_result(outcome)


def _first_lines(message: str, lines: int = 4) -> str:
    """llguidance's error, which may quote a large grammar, cut to its first lines."""
    return "\n".join(message.strip().splitlines()[:lines])
