"""A Lark grammar over raw text carried over to one over its JSON-escaped text, for a custom tool's input written
inside the JSON string of its call."""

from __future__ import annotations

import functools
import json
import re
import re._constants as sre  # noqa: F401 - the opcodes of re._parser's trees
import re._parser as sre_parse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lark.exceptions import LarkError
from lark.grammar import Rule, Terminal
from lark.lexer import PatternStr, TerminalDef
from lark.load_grammar import GrammarBuilder

# JSON's one canonical escaping of a string's characters (json.dumps with ensure_ascii=False): the quote and the
# backslash escaped, the control characters by their short escapes or \u00XX, every other character as it is. JSON
# allows others (\/, \u0041 for A); the grammar requires this one, so the model writes each input one way only.
SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
MAX_CHAR = sys.maxunicode
SURROGATES = (0xD800, 0xDFFF)  # never in UTF-8 text: left out of every class
# The Lark modules a grammar may import: lark's own common terminals (any other would be read from the server's disk).
IMPORTABLE = ("common",)
IMPORT = re.compile(r"^\s*%import\s+([\w.]+)", re.MULTILINE)
DECLARE = re.compile(r"^\s*%declare\b", re.MULTILINE)

Ranges = list[tuple[int, int]]  # inclusive code point ranges, sorted, apart


@dataclass(frozen=True)
class InputGrammar:
    """What a call's one string argument `key` must hold: `lark`, an llguidance grammar over its JSON-escaped text
    (escaped_lark) of a client's grammar of `source_chars` characters; `param` the field that held it, named where a
    call format cannot take it."""

    key: str
    lark: str
    param: str
    source_chars: int = 0


class Unsupported(ValueError):
    """A Lark grammar that cannot be carried over exactly; the message says what to change."""


def json_escaped(text: str) -> str:
    """`text` as it stands inside a JSON string, escaped canonically (SHORT_ESCAPES)."""
    return "".join(_escape(char) for char in text)


def _escape(char: str) -> str:
    if char in SHORT_ESCAPES:
        return SHORT_ESCAPES[char]
    return f"\\u{ord(char):04x}" if ord(char) < 0x20 else char


def escaped_lark(definition: str) -> str:
    """An llguidance Lark grammar whose texts are the JSON-escaped forms of texts of `definition` (a Lark grammar, as
    lark reads it). Escaping maps one character at a time, so each rule keeps its shape and each terminal becomes a
    rule of the same expression over escaped characters: its language exactly the escaped forms of the terminal's.
    Not one regex lexeme a terminal: a JSON character is up to six bytes escaped, and a lexer that ends a terminal at
    its longest match (llguidance's) would see the `\\` of `\\n` go on a /(.*)/ that takes `\\"` and be stuck at the
    `n` a raw lexer never saw; so escapes are lexemes of their own, and where a terminal may end the model writes it
    as llguidance writes the raw terminal (_item). %ignore'd terminals stand where Lark lets them: before each
    terminal and at the end. Unsupported where the grammar uses what cannot be carried over exactly."""
    for module in IMPORT.findall(definition):
        if module.split(".")[0] not in IMPORTABLE:
            raise Unsupported(f"%import {module}: only lark's common terminals can be imported (common.X)")
    if DECLARE.search(definition):
        raise Unsupported("%declare: declared terminals have no definition to enforce")
    try:
        builder = GrammarBuilder()
        builder.load_grammar(definition)
        terminals, rules, ignored = builder.build().compile(["start"], set())
    except LarkError as error:
        raise Unsupported(f"not a Lark grammar duo can read: {_first_line(error)}") from None
    names = {terminal.name: f"t{i}" for i, terminal in enumerate(terminals)}
    skip = " skipped" if ignored else ""
    lines = [f"start: r0{skip}"]
    if ignored:
        lines.append(f"skipped: ({' | '.join(names[name] for name in ignored)})*")
    lines += _rules(rules, {name: f"{skip.strip()} {rule}".strip() for name, rule in names.items()})
    lines += [f"{names[terminal.name]}: {_terminal(terminal)}" for terminal in terminals]
    return "\n".join(lines)


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _rules(rules: Sequence[Rule], terminals: dict[str, str]) -> list[str]:
    """The rules as llguidance reads them, every name replaced (lark's own names for what it made, __start_plus_0,
    are not all names llguidance takes): the grammar's start is r0; each terminal stands as `terminals` says."""
    names: dict[str, str] = {"start": "r0"}
    for rule in rules:
        names.setdefault(rule.origin.name, f"r{len(names)}")
    if any(rule.options.priority for rule in rules):
        raise Unsupported("rule priorities: the grammar is enforced as the language it defines, which has none")
    alternatives: dict[str, list[str]] = {}
    for rule in rules:
        symbols = [terminals[s.name] if isinstance(s, Terminal) else names[s.name] for s in rule.expansion]
        alternatives.setdefault(names[rule.origin.name], []).append(" ".join(symbols) or '""')
    return [f"{name}: {' | '.join(expansions)}" for name, expansions in alternatives.items()]


def _terminal(terminal: TerminalDef) -> str:
    """A terminal's escaped language as a rule: a string literal as its characters' escaped forms, a regex as the
    same expression over escaped characters."""
    pattern = terminal.pattern
    if terminal.priority:
        raise Unsupported(f"terminal priorities ({terminal.name}.{terminal.priority}): the grammar is enforced as "
                          "the language it defines, which has none")
    if pattern.flags - {"u"}:
        raise Unsupported(f"the {''.join(sorted(pattern.flags))} flag of {terminal.name}: only flagless terminals "
                          "are carried over")
    if isinstance(pattern, PatternStr):
        return " ".join(json.dumps(_escape(char)) for char in pattern.value) or '""'
    try:
        tree = sre_parse.parse(pattern.value)
    except re.error as error:
        raise Unsupported(f"the regex of {terminal.name}: {error}") from None
    flags = tree.state.flags
    if flags & (re.IGNORECASE | re.LOCALE):
        raise Unsupported(f"the regex of {terminal.name}: case-insensitive and locale flags are not carried over")
    return _sequence(tree, flags, ending=True)


def _sequence(items: Sequence[tuple], flags: int, ending: bool = False) -> str:
    """`items` in order; `ending`: the last one ends the terminal."""
    return " ".join(_item(op, av, flags, ending and i == len(items) - 1)
                    for i, (op, av) in enumerate(items)) or '""'


def _item(op: object, av: object, flags: int, ending: bool = False) -> str:
    """One node of re._parser's tree as a rule's expression over escaped characters, one lexeme each; but a repeated
    class that ends the terminal (the /(.*)/ of most grammars) as runs of what JSON writes as it is, one lexeme a run,
    and escapes, one lexeme each. A run is taken as far as it goes, as llguidance takes the raw terminal (OpenAI
    enforces custom tools' grammars with it), and masks 70 times faster over a 152k-token vocabulary than a lexeme a
    character (apply_patch: 0.3 against 23 ms a token)."""
    if op is sre.LITERAL:
        return json.dumps(_escape(chr(av)))
    if op in CHARACTER_OPS:
        return _one_of(_characters(op, av, flags))
    if op is sre.BRANCH:
        return "(" + " | ".join(_sequence(branch, flags, ending) for branch in av[1]) + ")"
    if op is sre.SUBPATTERN:
        group, add_flags, del_flags, inner = av
        if add_flags or del_flags:
            raise Unsupported("inline flags on a group ((?i:...)) are not carried over")
        return f"({_sequence(inner, flags, ending)})"
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):  # lazy or greedy, a terminal's language is the same
        low, high, inner = av
        if ending and low <= 1 and high == sre.MAXREPEAT and len(inner) == 1 and inner[0][0] in CHARACTER_OPS:
            return f"({_runs(_characters(*inner[0], flags))}){_repeat(low, high)}"
        return f"({_sequence(inner, flags)}){_repeat(low, high)}"
    raise Unsupported(f"{str(op).lower()} in a regex (lookarounds, backreferences, anchors, possessive and atomic "
                      "groups) cannot be enforced")


def _repeat(low: int, high: int) -> str:
    if high == sre.MAXREPEAT:
        return {0: "*", 1: "+"}.get(low, f"{{{low},}}")
    return {(0, 1): "?"}.get((low, high), f"{{{low},{high}}}")


CHARACTER_OPS = (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN)  # a node that matches one character


def _characters(op: object, av: object, flags: int) -> Ranges:
    """The characters one CHARACTER_OPS node matches."""
    if op is sre.LITERAL:
        return [(av, av)]
    if op is sre.NOT_LITERAL:
        return _complement([(av, av)])
    if op is sre.ANY:
        return _complement([]) if flags & re.DOTALL else _complement([(10, 10)])
    return _class(av, flags)


def _class(items: Sequence[tuple], flags: int) -> Ranges:
    """A [...] class's characters as ranges."""
    ranges: Ranges = []
    negate = False
    for op, av in items:
        if op is sre.NEGATE:
            negate = True
        elif op is sre.LITERAL:
            ranges.append((av, av))
        elif op is sre.RANGE:
            ranges.append(av)
        elif op is sre.CATEGORY:
            ranges += _category(av, ascii_only=bool(flags & re.ASCII))
        else:
            raise Unsupported(f"{str(op).lower()} in a regex class cannot be enforced")
    ranges = _merged(ranges)
    return _complement(ranges) if negate else ranges


@functools.cache
def _category(category: object, ascii_only: bool) -> tuple[tuple[int, int], ...]:
    """The characters of \\d, \\w, \\s or their negations, as Python's re reads them (Unicode unless ASCII)."""
    found = re.compile(f"[{_CATEGORIES[category]}]+", re.ASCII if ascii_only else 0)
    return tuple((match.start(), match.end() - 1) for match in found.finditer(_all_characters()))


_CATEGORIES = {sre.CATEGORY_DIGIT: r"\d", sre.CATEGORY_NOT_DIGIT: r"\D", sre.CATEGORY_WORD: r"\w",
               sre.CATEGORY_NOT_WORD: r"\W", sre.CATEGORY_SPACE: r"\s", sre.CATEGORY_NOT_SPACE: r"\S"}


@functools.cache
def _all_characters() -> str:
    """Every code point, in order, at its own index (the surrogates too, which no class keeps)."""
    return "".join(map(chr, range(MAX_CHAR + 1)))


def _merged(ranges: Iterable[tuple[int, int]]) -> Ranges:
    merged: Ranges = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return merged


def _complement(ranges: Ranges) -> Ranges:
    rest, start = [], 0
    for low, high in _merged(ranges):
        if low > start:
            rest.append((start, low - 1))
        start = high + 1
    return rest + ([(start, MAX_CHAR)] if start <= MAX_CHAR else [])


def _one_of(ranges: Ranges) -> str:
    """A lexeme of one character of `ranges` escaped: a regex of those JSON writes as they are in one class, and of
    each one it escapes as its escape."""
    plain, escaped = _split(ranges)
    return _lexeme(([_char_class(plain)] if plain else []) + escaped)


def _runs(ranges: Ranges) -> str:
    """A run of the characters of `ranges` JSON writes as they are (one lexeme), or one it escapes (another)."""
    plain, escaped = _split(ranges)
    if not plain and not escaped:
        raise Unsupported("a regex class that matches no character")
    return " | ".join(([f"/{_char_class(plain)}+/"] if plain else []) + ([_lexeme(escaped)] if escaped else []))


def _split(ranges: Ranges) -> tuple[Ranges, list[str]]:
    """The characters of `ranges` JSON writes as they are, and the regexes of the escapes of the others."""
    plain = _without(_merged(ranges), [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C), SURROGATES])
    escaped = [_escape(chr(code)) for low, high in _merged(ranges) for code in range(low, min(high, 0x5C) + 1)
               if code < 0x20 or code in (0x22, 0x5C)]
    return plain, ["".join(_regex_char(c) for c in text) for text in escaped]


def _lexeme(options: list[str]) -> str:
    if not options:
        raise Unsupported("a regex class that matches no character")
    return "/" + (options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")") + "/"


def _without(ranges: Ranges, removed: Ranges) -> Ranges:
    kept = _complement(_merged(removed))
    return [(max(low, k_low), min(high, k_high)) for low, high in ranges for k_low, k_high in kept
            if max(low, k_low) <= min(high, k_high)]


def _char_class(ranges: Ranges) -> str:
    parts = (_regex_char(chr(low)) if low == high else f"{_regex_char(chr(low))}-{_regex_char(chr(high))}"
             for low, high in ranges)
    return "[" + "".join(parts) + "]"


def _regex_char(char: str) -> str:
    """One character as a regex names it: letters and digits as they are, every other one by its code point (no
    character then means anything to the regex, to Lark's /.../ or to JSON)."""
    return char if char.isascii() and char.isalnum() else f"\\x{{{ord(char):x}}}"
