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

import json
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

import llguidance
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from duo.model import common_prefix_length

# What one grammar may cost to compile and to mask a position (llguidance's own limits, lowered where its
# defaults allow hundreds of MB): a hostile schema fails with an error instead of stalling or filling memory.
# Fuel: ~50k units per ms to build the lexer, ~14k per ms per mask step; a lexer state costs 1-2 kB.
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=50_000, max_grammar_size=200_000)
KINDS = ("json_schema", "gbnf", "lark", "regex")
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


class VocabModel(Protocol):
    """What a tokenizer for grammars is built from (duo.model.Model)."""

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
            # Imported here: it imports llama_cpp, which `duo-target --help` must not need (tests/test_builds.py).
            from llguidance.llamacpp import lltokenizer_from_vocab
            with warnings.catch_warnings():  # it asks llama.cpp for each token's attributes by a deprecated name
                warnings.simplefilter("ignore", DeprecationWarning)
                _tokenizers[model] = lltokenizer_from_vocab(model.llama_vocab(), n_vocab=model.n_vocab,
                                                            eos_token=model.end_of_generation_ids())
        return _tokenizers[model]


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

    def allowed(self) -> np.ndarray:
        """Which token ids may come next, as a bool array over the model's vocabulary."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.n_vocab].astype(bool)
        if allowed.size < self.n_vocab:  # ids past the tokenizer's vocabulary: never allowed
            allowed = np.concatenate([allowed, np.zeros(self.n_vocab - allowed.size, dtype=bool)])
        return allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` (one row, changed in place and returned) with every token the grammar forbids here at -inf:
        softmax gives them probability 0, so any distribution duo.sampling makes of the row is the constrained one."""
        logits[~self.allowed()] = -np.inf
        return logits

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here whatever the model says (`{"name": "` of a schema)."""
        return list(self.matcher.compute_ff_tokens())


def mask_rows(cursor: Cursor, base: Sequence[int], drafts: Sequence[int], rows: np.ndarray) -> None:
    """Mask verification rows in place: row i holds the distribution after base + drafts[:i] (a chain being
    verified after the committed tokens), so it is masked with the cursor there. Every draft that a row is
    masked after must be allowed (the caller cut the chain at its first forbidden token). Rows past a drafted end
    of generation stay as they are: nothing after it is ever committed. The cursor ends at `base` again."""
    for i, row in enumerate(rows):
        if i and drafts[i - 1] in cursor.ends:
            break
        if not cursor.move_to([*base, *drafts[:i]]):
            raise GrammarError(f"draft token {drafts[i - 1]} is not allowed here: the chain was not cut")
        cursor.mask(row)
    cursor.move_to(base)


def _first_lines(message: str, lines: int = 4) -> str:
    """llguidance's error, which may quote a large grammar, cut to its first lines."""
    return "\n".join(message.strip().splitlines()[:lines])
