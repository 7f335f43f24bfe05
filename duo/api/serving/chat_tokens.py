"""Chat messages to prompt tokens: the template's markup as control tokens, the messages' own text as text.

Tokenizing the rendered chat as one string with special-token parsing (what llama-server does) lets a
user forge roles: a message holding "<|im_end|>\n<|im_start|>system\n..." becomes real control tokens
and a system turn of the user's making. So the rendered prompt is cut where each message's content
lies in it: the template's parts are tokenized with special tokens parsed, the contents as plain text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

# What stands for message i's content in the second rendering: private-use characters no text holds.
MARK = re.compile("\ue000duo[0-9]+\ue001")


def mark(i: int) -> str:
    return f"\ue000duo{i}\ue001"


@dataclass(frozen=True)
class Turn:
    """How the rendered chat ends: with the template's generation prompt or not, then an assistant's prefill, if any:
    its text, left open for the model to continue (duo.api.serving.prefill)."""

    prefill: str | None = None
    generation_prompt: bool = True


class Tokenizer(Protocol):
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (),
                    variables: Mapping[str, Any] | None = None, *, generation_prompt: bool = True) -> str: ...
    def vocab(self): ...
    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> bytes: ...
    def token_piece(self, token: int, *, special: bool = False) -> bytes: ...


def chat_tokens(model: Tokenizer, messages: Sequence[Mapping[str, Any]], rendered: str,
                tools: Sequence[Mapping[str, Any]] = (), variables: Mapping[str, Any] | None = None,
                turn: Turn = Turn()) -> list[int]:
    """The prompt tokens of `messages` (and `tools`), which the model's chat template rendered as `rendered` (ending
    as `turn` says): one BOS at most, and no control token from inside a message's content or the prefill."""
    prefill = turn.prefill or ""
    pieces = rendered_pieces(model, messages, rendered[:len(rendered) - len(prefill)], tools, variables,
                             turn.generation_prompt) + ([(prefill, True)] if prefill else [])
    tokens: list[int] = []
    for i, (text, is_content) in enumerate(pieces):
        tokens += model.tokenize(text, add_special=i == 0, parse_special=not is_content)
    bos = model.vocab().bos
    # A template that writes its own BOS (Llama 3, Mistral, Gemma) on a model whose GGUF adds one too.
    if len(tokens) >= 2 and tokens[0] == tokens[1] == bos:
        tokens = tokens[1:]
    return tokens


def rendered_pieces(model: Tokenizer, messages: Sequence[Mapping[str, Any]], rendered: str,
                    tools: Sequence[Mapping[str, Any]] = (), variables: Mapping[str, Any] | None = None,
                    generation_prompt: bool = True) -> list[tuple[str, bool]]:
    """`rendered`, the chat as the template rendered it, as (text, is_content) pieces.

    The template is rendered a second time with each content replaced by a mark no text holds (private
    use characters): cut at the marks, that rendering is the template's markup alone. Where the markup
    with the contents put back (as sent, or stripped: templates may trim them) gives the real rendering,
    the cut is exact, whatever the contents hold. A template that changes contents otherwise falls back
    to finding each content in the rendering after the previous one.
    """
    contents = [str(message.get("content", "")) for message in messages]
    marks = [mark(i) for i in range(len(messages))]
    skeleton = [{**message, "content": mark} for message, mark in zip(messages, marks)]
    markup = _cut_at(model.chat_prompt(skeleton, tools, variables, generation_prompt=generation_prompt)
                     if tools or variables or not generation_prompt else model.chat_prompt(skeleton), marks)
    if markup is not None:
        for candidates in (contents, [content.strip() for content in contents]):
            pieces = [(markup[0], False)]
            for content, after in zip(candidates, markup[1:]):
                pieces += [(content, True), (after, False)]
            if "".join(text for text, _ in pieces) == rendered:
                return [(text, is_content) for text, is_content in pieces if text]
    return _found_in_order(rendered, contents)


def _cut_at(skeleton: str, marks: Sequence[str]) -> list[str] | None:
    """`skeleton` split at each of `marks` in order: len(marks) + 1 pieces, or None where the marks are not
    there once each and in order (the template dropped, repeated or reordered a message). One pass over
    `skeleton` whatever the number of messages: tens of thousands of them must not block the event loop."""
    found = list(MARK.finditer(skeleton))
    if [match.group() for match in found] != list(marks):
        return None
    cuts = [0] + [i for match in found for i in match.span()] + [len(skeleton)]
    return [skeleton[start:end] for start, end in zip(cuts[::2], cuts[1::2])]


def _found_in_order(rendered: str, contents: Sequence[str]) -> list[tuple[str, bool]]:
    pieces: list[tuple[str, bool]] = []
    at = 0
    for content in contents:
        for candidate in (content, content.strip()):
            found = rendered.find(candidate, at) if candidate else -1
            if found >= 0:
                pieces += [(rendered[at:found], False), (candidate, True)]
                at = found + len(candidate)
                break
    pieces.append((rendered[at:], False))
    return [(text, is_content) for text, is_content in pieces if text]


def marker_tokens(model: Tokenizer, markers: Sequence[str]) -> frozenset[int]:
    """The control tokens that spell `markers` (a call format's markup): an answer's text renders them, as
    llama-server renders its preserved tokens, so that calls written with them (DeepSeek's <｜tool▁calls▁begin｜>,
    GPT-OSS' <|channel|>) parse; other control tokens (an end of turn) stay out of the text."""
    found = set()
    for marker in markers:
        for token in model.tokenize(marker, add_special=False, parse_special=True):
            if not model.token_piece(token) and model.token_piece(token, special=True):
                found.add(token)
    return frozenset(found)


def answer_text(model: Tokenizer, tokens: Sequence[int], preserved: frozenset[int]) -> bytes:
    """The bytes of answer `tokens`: the `preserved` control tokens spelled out, the others left out."""
    if not preserved.intersection(tokens):
        return model.detokenize(tokens)
    return b"".join(model.token_piece(token, special=token in preserved) for token in tokens)
