"""A model's vocabulary as a draft/target pair must share it, and llama.cpp's rules for when they do."""

from __future__ import annotations

from dataclasses import dataclass

from duo.llama.errors import ModelError

# llama.cpp's rules for a draft/target pair (common/speculative.cpp): the first few ids are
# control tokens that may legitimately differ, and a few extra tokens at the end are tolerated.
VOCAB_CHECK_START_ID = 5
VOCAB_MAX_SIZE_DIFFERENCE = 128


class IncompatibleVocab(ModelError):
    """A draft model's vocabulary does not match the target's."""


@dataclass(frozen=True)
class Vocab:
    """What a draft/target pair must agree on, with the full token texts for a precise diagnosis."""

    vocab_type: int
    bos: int
    eos: int
    add_bos: bool
    add_eos: bool
    token_texts: tuple[bytes, ...]

    @property
    def n_vocab(self) -> int:
        return len(self.token_texts)


def check_compatible(target: Vocab, draft: Vocab) -> None:
    """Raise IncompatibleVocab unless `draft` may draft for `target` under llama.cpp's rules."""
    if target.vocab_type != draft.vocab_type:
        raise IncompatibleVocab(
            f"vocabulary types differ: target {target.vocab_type}, draft {draft.vocab_type}")
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        raise IncompatibleVocab(
            f"BOS differs: target add_bos={target.add_bos} id={target.bos}, "
            f"draft add_bos={draft.add_bos} id={draft.bos}")
    if target.add_eos != draft.add_eos or (target.add_eos and target.eos != draft.eos):
        raise IncompatibleVocab(
            f"EOS differs: target add_eos={target.add_eos} id={target.eos}, "
            f"draft add_eos={draft.add_eos} id={draft.eos}")
    size_difference = abs(target.n_vocab - draft.n_vocab)
    if size_difference > VOCAB_MAX_SIZE_DIFFERENCE:
        raise IncompatibleVocab(
            f"vocabulary sizes differ by {size_difference} (target {target.n_vocab}, draft "
            f"{draft.n_vocab}); at most {VOCAB_MAX_SIZE_DIFFERENCE} is allowed")
    n_common = min(target.n_vocab, draft.n_vocab)
    if target.token_texts[VOCAB_CHECK_START_ID:n_common] == draft.token_texts[VOCAB_CHECK_START_ID:n_common]:
        return  # one comparison in C: a Hello is checked at every join, and a loop in Python held the event loop
    for token_id in range(VOCAB_CHECK_START_ID, n_common):
        if target.token_texts[token_id] != draft.token_texts[token_id]:
            raise IncompatibleVocab(
                f"token {token_id} differs: target {_clipped(target.token_texts[token_id])}, "
                f"draft {_clipped(draft.token_texts[token_id])}; the draft must use the target's tokenizer")


def _clipped(text: bytes, limit: int = 64) -> str:
    """A token's text for a message: a peer's vocabulary may hold texts of any size."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} bytes)"
