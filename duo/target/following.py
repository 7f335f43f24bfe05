"""Requests reading the same prompt prefix at once read it once: the later one waits for the earlier one's cells.

Why: an agent starts sub-agents side by side, each with the same long system prompt and tools (Claude Code: two
11.4k-token prompts 45 s apart). A prefix some sequence holds is adopted with no recompute
(duo.llama.context.Context.adopt_prefix), but one still being read is held only as far as its read got: each request
read the whole prompt beside the other, both at half the core's pace. Following, the later request waits while the
earlier one reads the shared part with the whole core, then adopts those cells and reads only what is its own.

The core then does the shared part once. The leader is never slower (its calls carry no prompt chunk of the
follower's while it reads the shared part), and the follower no later than reading beside it: both reads draw on one
core, and with less work in all the follower's read ends no later, up to the chunk in flight when it begins to wait.
A follower follows only a read that began before its own (no two wait on each other) and only for at least
one chunk of shared tokens ahead of it (a template's few shared tokens are not worth a call's wait).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from duo.llama.context import Context, common_prefix_length


class Readers:
    """The requests reading their prompt now (not private ones: their cells are no one's to share), in the order their
    reads began, and a signal after each call that read a prompt chunk and each read's end."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self._prompts: dict[int, Sequence[int]] = {}  # sequence -> the prompt it reads; a dict keeps their order
        self._progress = asyncio.Event()

    def start(self, seq: int, prompt: Sequence[int]) -> None:
        self._prompts[seq] = prompt

    def stop(self, seq: int) -> None:
        """`seq`'s read ended (or its request did): those who follow it go on by themselves."""
        if self._prompts.pop(seq, None) is not None:
            self.progressed()

    def progressed(self) -> None:
        """A call read prompt chunks, or a read ended: the followers look again."""
        self._progress.set()
        self._progress = asyncio.Event()

    def leader(self, seq: int, prompt: Sequence[int], pos: int) -> tuple[int, int] | None:
        """The read that began before `seq`'s and will hold the most of `prompt` past `pos`, at least a call's worth
        (n_batch tokens) more: its sequence, and how many leading tokens of `prompt` it reads. None where there is
        none, or `seq` is not reading."""
        if seq not in self._prompts:
            return None
        best: tuple[int, int] | None = None
        for other, tokens in self._prompts.items():
            if other == seq:
                break  # the later reads follow this one, not the other way round
            shared = common_prefix_length(tokens, prompt)
            if shared - pos >= self.context.n_batch and (best is None or shared > best[1]):
                best = (other, shared)
        return best

    async def follow(self, leader: int, shared: int) -> None:
        """Wait until `leader` holds `shared` tokens (leader()'s answer), or its read ended."""
        # len() of the list the model thread extends is read whole under the GIL: at worst a call behind.
        while leader in self._prompts and len(self.context.held(leader)) < shared:
            await self._progress.wait()
