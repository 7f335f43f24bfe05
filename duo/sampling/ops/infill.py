"""llama.cpp's "infill" sampler: the transform editors ask for (`samplers: [top_k, top_p, infill]`) on code completion.

It reshapes an already truncated distribution so that a completion ends where the hole does and does not dither
between spellings of the same text. With p over n candidates (after top-k / top-p), E the end-of-generation tokens:
  1. If 3 n p(E) > p(not E): keep E alone, renormalised (ending is at least a third as likely as an average token).
  2. Otherwise merge tokens whose text is a prefix of another's (" ret" and " return" spell the same start): in
     rank order, each pair's probability goes to the likelier of the two (the prefix on a tie), the other leaves.
  3. Drop text tokens under 0.2 (merged probabilities) and renormalise; no text token left: the end-of-turn token
     (where the row allows it: one the grammar or logit_bias bans falls back as a vocabulary without it does).
  4. With m text tokens left, drop text tokens under 1 / (m + 1) and renormalise.
The merged probabilities only decide which tokens survive: llama.cpp's last sampler (dist) draws from the softmax
of the survivors' logits, i.e. their probabilities before the merge, renormalised; so does this.
A deterministic function of one row's distribution, so speculation stays exact under it: the target verifies with
p = infill(truncated row) and the draft, applying it too, samples q from the same shape.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# The most candidates the transform takes: step 2 compares every pair (llama.cpp's quadratic loop), so a
# request must truncate first; llama.vscode and llama.vim send top_k 40.
MAX_CANDIDATES = 64  # 0.6 ms a row at 40 in Python; the pairwise merge is quadratic
_TEXT_FLOOR = 0.2


@dataclass(frozen=True, eq=False)
class InfillVocab:
    """What the transform needs to know of a vocabulary: which tokens end generation, the end-of-turn token it
    falls back to, and each token's text (special tokens spell nothing, as llama.cpp renders them here)."""

    eog: frozenset[int]
    eot: int | None  # a vocabulary with neither end-of-turn nor end-of-sequence token never falls back
    piece: Callable[[int], bytes]


class InfillModel(Protocol):
    """What the transform reads of a model (duo.llama.model.Model is one)."""

    def special_token(self, name: str) -> int | None: ...

    def end_of_generation_ids(self) -> list[int]: ...

    def token_piece(self, token: int, *, special: bool = False) -> bytes: ...


_vocabs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its InfillVocab


def infill_vocab(model: InfillModel) -> InfillVocab:
    """`model`'s InfillVocab, built once per model (finding its end-of-generation tokens walks the vocabulary)."""
    if model not in _vocabs:
        eot = model.special_token("eot")
        eot = model.special_token("eos") if eot is None else eot
        pieces: dict[int, bytes] = {}
        held = weakref.ref(model)  # the cache must not keep its key alive

        def piece(token: int) -> bytes:
            if token not in pieces:
                pieces[token] = held().token_piece(token)  # type: ignore[union-attr]
            return pieces[token]

        _vocabs[model] = InfillVocab(frozenset(model.end_of_generation_ids()), eot, piece)
    return _vocabs[model]


def infill(ids: np.ndarray, probs: np.ndarray, vocab: InfillVocab,
           row: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The infill transform of the distribution `probs` over `ids` (most probable first, as truncation leaves them;
    see the module) from `row`'s logits (None: nothing is banned): the ids it keeps and their probabilities."""
    original, probs = probs, probs.copy()
    is_eog = np.fromiter((int(t) in vocab.eog for t in ids), dtype=bool, count=ids.size)
    p_eog, p_text = probs[is_eog].sum(), probs[~is_eog].sum()
    if 3 * p_eog * ids.size > p_text:
        return ids[is_eog], probs[is_eog] / p_eog
    alive = _merge_prefixes(ids, probs, vocab)
    keep = alive & (is_eog | (probs >= _TEXT_FLOOR))
    texts = int(np.count_nonzero(keep & ~is_eog))
    if texts == 0:
        # llama.cpp's fallback; a vocabulary without such a token, or a row that bans it (-inf: the request's grammar
        # or logit_bias), keeps the likeliest candidate left, which the row allows (it has probability).
        allowed = vocab.eot is not None and (row is None or row[vocab.eot] > -np.inf)
        end = vocab.eot if allowed else int(ids[alive][np.argmax(probs[alive])])
        return np.array([end]), np.array([1.0])
    probs = np.where(keep, probs, 0.0) / probs[keep].sum()
    keep &= is_eog | (probs >= 1.0 / (texts + 1))
    return ids[keep], original[keep] / original[keep].sum()


def _merge_prefixes(ids: np.ndarray, probs: np.ndarray, vocab: InfillVocab) -> np.ndarray:
    """Step 2, in place on `probs`, in llama.cpp's order: which candidates are still alive."""
    pieces = [vocab.piece(int(t)) for t in ids]
    alive = np.ones(ids.size, dtype=bool)
    for i0 in range(ids.size):
        for i1 in range(ids.size):
            if not alive[i0]:
                break
            if i0 == i1 or not alive[i1]:
                continue
            a, b = pieces[i0], pieces[i1]
            if a and len(a) <= len(b) and b.startswith(a):
                dst, src = (i1, i0) if probs[i1] > probs[i0] else (i0, i1)
                probs[dst] += probs[src]
                probs[src] = 0.0
                alive[src] = False
    return alive
