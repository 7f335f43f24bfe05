"""Free drafts from the context: where the text just committed (or just drafted) repeats an earlier n-gram of the
prompt or the output, the tokens that followed it there are proposed (prompt lookup decoding; llama.cpp's
ngram-* speculative modes, vLLM's and SGLang's n-gram proposers).

What a coding assistant writes is often in its context already: an edited function, a diff, a test that repeats
the code under test, JSON echoing its input. Those tokens cost nothing to propose. A proposal is a draft with a
point distribution (q = 1): residual verification accepts it with probability p(x) and otherwise samples the
residual, p without x, so the output stays exactly the target's (duo.sampling.verification.verify_stochastic); greedy and
coupled verification accept it only where it is the target's own choice.

The index maps every n-gram (MIN_N..MAX_N tokens) of the context but the one ending at its last token to where its
latest occurrence ends; the longest n-gram that ends the text and occurred before wins. It grows with the
committed tokens only (drafts are looked up, never indexed): at most MAX_N - MIN_N + 1 entries per context token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

MIN_N = 2  # one token matches too often to be worth a verify row
MAX_N = 4


class ContextLookup:
    """One session's n-gram index over its context (`tokens`: the committed sequence, which its owner extends as
    tokens are committed; the index follows it, and never writes it)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions < this are indexed

    def _catch_up(self) -> None:
        # The n-gram ending at the last token is left out: looking the text's own end up must find an earlier one.
        for end in range(max(self.indexed, MIN_N), len(self.tokens)):
            for n in range(MIN_N, min(MAX_N, end) + 1):
                self.index[tuple(self.tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(self.tokens))

    async def index_off_loop(self) -> None:
        """Index the tokens so far on a worker thread, so that proposals later index only what commits add.

        The first catch-up covers the whole prompt, about 1 to 2 µs a token (130 to 280 ms at 128k tokens): on the
        event loop it would hold up every client's events. On a thread the loop still takes the GIL back at each
        switch interval (5 ms). The owner must not extend `tokens` until this returns."""
        await asyncio.to_thread(self._catch_up)

    def propose(self, drafted: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed, earlier in the context, the longest n-gram ending the committed
        tokens followed by `drafted` (the pending drafts before the proposal)."""
        if limit <= 0:
            return []
        self._catch_up()
        tail = list(self.tokens[-MAX_N:]) + list(drafted)
        for n in range(min(MAX_N, len(tail)), MIN_N - 1, -1):
            end = self.index.get(tuple(tail[-n:]))
            if end is not None:
                return self.tokens[end:end + limit]
        return []
