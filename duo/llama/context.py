"""A KV cache on a model: decode tokens of several sequences in one call, roll back, fork, shift, share prefixes."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Protocol, Sequence

import numpy as np

from duo.llama.backends import llama
from duo.llama.errors import ModelError


class Weights(Protocol):
    """What a context needs of the model it runs (duo.llama.model.Model)."""

    path: Path
    threads: int
    on_gpu: bool

    @property
    def n_vocab(self) -> int: ...

    @property
    def n_ctx_train(self) -> int: ...

    @property
    def native(self) -> Any: ...  # llama_cpp._internals.LlamaModel


@dataclass(frozen=True)
class Part:
    """One sequence's share of a batched decode: `tokens` at positions pos, pos+1, ... of sequence
    `seq`, with the logits of its indices in `logits_for` (default: its last token)."""

    seq: int
    pos: int
    tokens: Sequence[int]
    logits_for: Sequence[int] | None = None

    def outputs(self) -> list[int]:
        return [len(self.tokens) - 1] if self.logits_for is None else list(self.logits_for)


class Context:
    """A KV cache on a model: decode tokens at absolute positions, roll back to a position.

    It holds n_seq sequences in one cache of `cells` cells (llama.cpp's unified KV cache), each up
    to n_ctx positions long. Sequence 0 is the main one. Sequences decode together in one call
    (decode_parts): the weights are read once for all of them, which is what makes serving several
    requests, or drafting for several sessions, cheaper than taking turns. A sequence can also fork
    from sequence 0's prefix at no cost (llama.cpp tags the same cache cells with both ids).
    """

    def __init__(self, model: Weights, *, n_ctx: int, n_batch: int, n_seq: int = 1, cells: int | None = None,
                 flash_attn: bool | None = None) -> None:
        """`flash_attn`: llama.cpp's flash attention on or off; None: off on a CPU, where its kernel reads the whole
        cache once per query row and runs slower than the plain attention (scripts/measure_context.py: at 2k tokens
        of context the Q4_0 draft took 217 against 127 ms a token, 821 against 477 ms a step of 8), llama.cpp's
        choice on a GPU (as llama-server's -fa auto)."""
        n_ctx = min(n_ctx, model.n_ctx_train)
        params = llama()._internals.LlamaContext.default_params()
        params.n_ctx = max(cells or n_ctx, n_ctx)
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        # One pool of cells for all sequences: else llama.cpp splits them evenly between the sequences
        # and cuts a batch whose sequences hold different numbers of tokens into one call per sequence
        # (measured: 4 sequences of 5, 1, 3, 1 tokens cost 6.3 single steps split, 3.5 unified).
        params.kv_unified = True
        if flash_attn is None and not model.on_gpu:
            flash_attn = False
        if flash_attn is not None:
            params.flash_attn_type = (llama().LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                      else llama().LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.n_threads = model.threads
        params.n_threads_batch = model.threads
        params.no_perf = True
        if not model.on_gpu:
            # Keep a CPU-only model entirely on the CPU even in a GPU build.
            params.offload_kqv = False
            params.op_offload = False
        self.model = model
        try:
            self._ctx = llama()._internals.LlamaContext(model=model.native, params=params, verbose=False)
        except ValueError as error:
            raise ModelError(f"cannot create a context of {params.n_ctx} tokens: {error}") from error
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        self.flash_attn = flash_attn  # as asked of llama.cpp (None: its choice)
        # llama.cpp pads the cache to a multiple of 256 but caps a batch at the context size asked for.
        self.n_batch = llama().llama_n_batch(self._ctx.ctx)
        self._held: list[list[int]] = [[] for _ in range(n_seq)]  # the tokens in sequence s's cache, by position
        self._batch = llama()._internals.LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1, verbose=False)

    @property
    def n_past(self) -> int:
        """Positions [0, n_past) of the main sequence are in the KV cache."""
        return len(self._held[0])

    def past(self, seq: int) -> int:
        """Positions [0, past(seq)) of sequence `seq` are in the KV cache."""
        return len(self._held[seq])

    def held(self, seq: int) -> Sequence[int]:
        """The tokens sequence `seq` holds, position by position."""
        return self._held[seq]

    def decode(self, tokens: Sequence[int], pos: int, logits_for: Sequence[int] | None = None,
               seq: int = 0) -> np.ndarray:
        """Decode `tokens` at positions pos, pos+1, ... of sequence `seq`, n_batch tokens per call; return
        the logits of the indices in `logits_for` (default: the last token) as float32 [len(logits_for), n_vocab]."""
        wanted = [len(tokens) - 1] if logits_for is None else list(logits_for)
        rows: list[np.ndarray] = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            outputs = [i - start for i in wanted if start <= i < start + len(chunk)]
            rows.extend(self.decode_parts([Part(seq, pos + start, chunk, outputs)]))
        return np.concatenate(rows) if rows else np.empty((0, self.model.n_vocab), dtype=np.float32)

    def decode_parts(self, parts: Sequence[Part]) -> list[np.ndarray]:
        """Decode every part in one call (at most n_batch tokens in all, each sequence in one part);
        return each part's logits, float32 [len(outputs), n_vocab]. On failure no sequence keeps any
        of the call's tokens."""
        for part in parts:
            self._check_room(part)
        if sum(len(part.tokens) for part in parts) > self.n_batch:
            raise ModelError(f"a batch of {sum(len(part.tokens) for part in parts)} tokens exceeds n_batch {self.n_batch}")
        if len({part.seq for part in parts}) < len(parts):
            raise ModelError("one sequence appears twice in a batch")
        self._fill_batch(parts)
        try:
            self._ctx.decode(self._batch)
        except RuntimeError as error:
            for part in parts:
                self.rollback(part.pos, part.seq)
            raise ModelError(f"llama_decode failed: {error}") from error
        for part in parts:
            self._held[part.seq][part.pos:] = part.tokens
        n_rows = sum(len(part.outputs()) for part in parts)
        logits = np.ctypeslib.as_array(llama().llama_get_logits(self._ctx.ctx), shape=(n_rows, self.model.n_vocab))
        rows, first = [], 0
        for part in parts:
            n = len(part.outputs())
            rows.append(logits[first:first + n].copy())
            first += n
        return rows

    def _check_room(self, part: Part) -> None:
        if part.pos != self.past(part.seq):
            raise ModelError(f"decode at position {part.pos}, but the KV cache holds {self.past(part.seq)} "
                             f"positions of sequence {part.seq}")
        if part.pos + len(part.tokens) > self.n_ctx:
            raise ModelError(f"context full: {part.pos} + {len(part.tokens)} tokens exceed the context of {self.n_ctx}")

    def _fill_batch(self, parts: Sequence[Part]) -> None:
        """Lay the parts out one after another; llama.cpp returns the logits rows in this order."""
        batch = self._batch.batch
        batch.n_tokens = sum(len(part.tokens) for part in parts)
        i = 0
        for part in parts:
            wanted = set(part.outputs())
            for j, token in enumerate(part.tokens):
                batch.token[i] = token
                batch.pos[i] = part.pos + j
                batch.seq_id[i][0] = part.seq
                batch.n_seq_id[i] = 1
                batch.logits[i] = j in wanted
                i += 1

    def rollback(self, n: int, seq: int = 0) -> None:
        """Forget positions >= n of sequence `seq` so that decoding can resume at position n."""
        if n >= self.past(seq):
            return
        if not self._ctx.kv_cache_seq_rm(seq, n, -1):
            raise ModelError(
                f"{self.model.path.name} cannot roll its state back to position {n} (recurrent or hybrid "
                "models keep no per-position cache); duo needs an attention-only model")
        del self._held[seq][n:]

    def fork(self, seq: int, n: int, source: int = 0) -> None:
        """Make sequence `seq` hold positions [0, n) of sequence `source`, and nothing else.

        No recompute: the cells of those positions are tagged with `seq` too. This costs next to
        nothing where re-decoding the prefix would cost a batch of n tokens.
        """
        n = min(n, self.past(source))
        self._ctx.kv_cache_seq_rm(seq, 0, -1)
        self._ctx.kv_cache_seq_cp(source, seq, 0, n)
        self._held[seq] = self._held[source][:n]

    def adopt_prefix(self, seq: int, tokens: Sequence[int], private: Collection[int] = ()) -> int:
        """Make sequence `seq` hold the longest prefix of `tokens` that it or a sequence outside `private` holds,
        and nothing else; return its length (the tokens that need no decoding). `private` sequences' cells are no
        one's to share (cache_prompt false): `seq` among them is emptied first.

        Requests that share a system prompt, or a conversation's next turn (its prompt is the previous
        prompt and answer plus a new message), then skip the shared part: its own cells where `seq`
        holds it, else cells shared with the sequence that does (fork), with no recompute either way.
        """
        if seq in private:
            self.clear(seq)
        shared = self._shared(seq, tokens, private)
        source = max(shared, key=lambda s: (shared[s], s == seq))  # among equals its own cells: no copy
        n = shared[source]
        if source == seq:
            self.rollback(n, seq)
        else:
            self.fork(seq, n, source)
        return n

    def reusable(self, seq: int, tokens: Sequence[int], private: Collection[int] = ()) -> int:
        """How many of `tokens` adopt_prefix would give sequence `seq`, doing nothing."""
        return 0 if seq in private else max(self._shared(seq, tokens, private).values())

    def _shared(self, seq: int, tokens: Sequence[int], private: Collection[int]) -> dict[int, int]:
        """Of `seq` and every sequence outside `private`, how many leading tokens of `tokens` it holds."""
        return {source: common_prefix_length(self._held[source], tokens)
                for source in range(self.n_seq) if source == seq or source not in private}

    def saved(self, seq: int) -> ctypes.Array:
        """Sequence `seq`'s cells as llama.cpp writes them (each one's position, keys and values): restore() puts
        them back, in this context only. A copy in host memory: ~28 KiB a token for an F16 Qwen2.5 1.5B."""
        size = llama().llama_state_seq_get_size_ext(self._ctx.ctx, seq, 0)
        if not size:  # llama.cpp's answer to an error (an empty sequence's state still has a header)
            raise ModelError(f"llama.cpp could not size sequence {seq}'s cells")
        state = (ctypes.c_uint8 * size)()
        if llama().llama_state_seq_get_data_ext(self._ctx.ctx, state, size, seq, 0) != size:
            raise ModelError(f"llama.cpp did not write the {size} bytes of sequence {seq}'s cells")
        return state

    def restore(self, seq: int, state: ctypes.Array, tokens: Sequence[int]) -> bool:
        """Make sequence `seq` hold `tokens` again from their `state` (saved()), and nothing else; False where the
        cache has no run of free cells that long (llama.cpp restores a sequence's cells side by side): `seq` then
        holds nothing."""
        read = llama().llama_state_seq_set_data_ext(self._ctx.ctx, state, len(state), seq, 0)
        if not read or read != len(state):
            self.clear(seq)
            return False
        self._held[seq] = list(tokens)
        return True

    def drop(self, seq: int, start: int, n: int) -> bool:
        """Forget positions [start, start + n) of sequence `seq` and move the later ones n positions down, as
        llama.cpp's context shift does (its K-shift re-rotates their keys at the next decode: no recompute); False,
        and nothing done, where that is not possible: a model whose memory cannot shift, or cells past start + n
        that another sequence shares (a shift moves a cell for every sequence that holds it)."""
        held = self._held[seq]
        if n <= 0 or start + n >= len(held) or not llama().llama_memory_can_shift(self._ctx.memory):
            return False
        if any(common_prefix_length(self._held[other], held) > start + n
               for other in range(self.n_seq) if other != seq):
            return False
        self._ctx.kv_cache_seq_rm(seq, start, start + n)
        self._ctx.kv_cache_seq_shift(seq, start + n, -1, -n)
        del held[start:start + n]
        return True

    def clear(self, seq: int) -> None:
        """Forget all of sequence `seq`, freeing its cells for the other sequences."""
        self._ctx.kv_cache_seq_rm(seq, 0, -1)
        self._held[seq] = []

    def close(self) -> None:
        self._batch.close()
        self._ctx.close()


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if not n or a[0] != b[0]:  # another conversation: no copies of either
        return 0
    if list(a[:n]) == list(b[:n]):  # the common case (a session catching up) in one comparison
        return n
    return next(i for i in range(n) if a[i] != b[i])

