"""Conversions between the protobuf messages of proto/duo.proto and duo's own types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duo.net._proto import duo_pb2 as pb
from duo.llama.model import Model
from duo.llama.vocab import Vocab
from duo.sampling.distributions import SparseDist
from duo.sampling.ops.dry import Dry
from duo.sampling.ops.infill import infill_vocab
from duo.sampling.ops.penalties import Penalties
from duo.sampling.params import DEFAULT_ORDER, SamplingParams

PROTOCOL = "duo/3"  # 2: branches; 3: coupled sampling (OpenSession.verification)
# Branches per chain the draft keeps at most (duo-draft --max-branches); the target accepts this many
# per commit, and counts epochs accordingly.
MAX_BRANCHES = 4


@dataclass(frozen=True)
class ChainChunk:
    """Chain tokens at positions start, start + 1, ... of chain `epoch`, as the link let them through."""

    epoch: int
    start: int
    tokens: list[int]
    # The distribution each token was drawn from; empty for greedy sessions, None at a position committed
    # when the chunk arrived (never verified: not even parsed).
    dists: list[SparseDist | None]
    branch_of: int | None = None  # set on a branch's first chunk: the epoch of the chain it forks from
    paused: bool = False  # the draft stopped this chain after these tokens, until the next commit
    # The draft model's probability of each token, in [0, 1] (duo.draft.confidence); empty from a draft that sends none.
    confidences: list[float] = field(default_factory=list)


def sampling_to_pb(params: SamplingParams, seed: int | None, penalties: Penalties = Penalties()) -> pb.SamplingParams:
    dry = penalties.dry
    message = pb.SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                top_p=params.top_p, min_p=params.min_p, presence_penalty=penalties.presence,
                                frequency_penalty=penalties.frequency, repeat_penalty=penalties.repeat,
                                repeat_last_n=penalties.repeat_last_n, logit_bias=dict(penalties.bias),
                                infill=params.infill is not None, typical_p=params.typical_p,
                                top_n_sigma=params.top_n_sigma, min_keep=params.min_keep,
                                xtc_probability=params.xtc_probability, xtc_threshold=params.xtc_threshold,
                                dynatemp_range=params.dynatemp_range, dynatemp_exponent=params.dynatemp_exponent,
                                mirostat=params.mirostat, mirostat_tau=params.mirostat_tau,
                                mirostat_eta=params.mirostat_eta, dry_multiplier=dry.multiplier, dry_base=dry.base,
                                dry_allowed_length=dry.allowed_length, dry_penalty_last_n=dry.penalty_last_n,
                                dry_sequence_breakers=list(dry.breakers))
    if params.order != DEFAULT_ORDER:
        message.sampler_order = params.order
    if seed is not None:
        message.seed = seed
    return message


def penalties_from_pb(message: pb.SamplingParams) -> Penalties:
    """The penalties (unchecked: Penalties.validate; DRY's restart sequences not yet found: Penalties.for_vocab);
    repeat_penalty 0 and an unset optional field are the defaults."""
    window = message.repeat_last_n if message.HasField("repeat_last_n") else Penalties.repeat_last_n
    dry = Dry(multiplier=float(message.dry_multiplier), base=_field(message, "dry_base", float, Dry.base),
              allowed_length=_field(message, "dry_allowed_length", int, Dry.allowed_length),
              penalty_last_n=_field(message, "dry_penalty_last_n", int, Dry.penalty_last_n),
              breakers=tuple(message.dry_sequence_breakers))
    return Penalties(presence=float(message.presence_penalty), frequency=float(message.frequency_penalty),
                     repeat=float(message.repeat_penalty) or 1.0, repeat_last_n=window,
                     bias=tuple(sorted((int(token), float(value)) for token, value in message.logit_bias.items())),
                     dry=dry)


def sampling_from_pb(message: pb.SamplingParams, model: Model | None) -> tuple[SamplingParams, int | None]:
    """The params and the seed (None when unset); top_p and typical_p 0 mean an unset field, i.e. 1. `model`: the
    receiving side's, whose vocabulary the infill sampler reads where the message asks for it (None: it cannot)."""
    if message.infill and model is None:
        raise ValueError("the infill sampler needs the model's vocabulary")
    defaults = SamplingParams()
    params = SamplingParams(temperature=float(message.temperature), top_k=int(message.top_k),
                            top_p=float(message.top_p) or 1.0, min_p=float(message.min_p),
                            infill=infill_vocab(model) if message.infill else None,
                            typical_p=float(message.typical_p) or 1.0, top_n_sigma=float(message.top_n_sigma),
                            min_keep=int(message.min_keep), xtc_probability=float(message.xtc_probability),
                            xtc_threshold=_field(message, "xtc_threshold", float, defaults.xtc_threshold),
                            dynatemp_range=float(message.dynatemp_range),
                            dynatemp_exponent=_field(message, "dynatemp_exponent", float, defaults.dynatemp_exponent),
                            mirostat=int(message.mirostat),
                            mirostat_tau=_field(message, "mirostat_tau", float, defaults.mirostat_tau),
                            mirostat_eta=_field(message, "mirostat_eta", float, defaults.mirostat_eta),
                            order=_field(message, "sampler_order", str, DEFAULT_ORDER))
    return params, (message.seed if message.HasField("seed") else None)


def _field(message: pb.SamplingParams, name: str, kind: type, default: Any) -> Any:
    """An optional field's value, or its default where unset."""
    return kind(getattr(message, name)) if message.HasField(name) else default


def mu_from_pb(message: pb.OpenSession | pb.Commit) -> float | None:
    """Mirostat's state mu a message carries (None where it carries none)."""
    return float(message.mirostat_mu) if message.HasField("mirostat_mu") else None


def vocab_to_pb(vocab: Vocab) -> pb.Vocab:
    return pb.Vocab(vocab_type=vocab.vocab_type, bos=vocab.bos, eos=vocab.eos, add_bos=vocab.add_bos,
                    add_eos=vocab.add_eos, token_texts=list(vocab.token_texts))


def vocab_from_pb(message: pb.Vocab) -> Vocab:
    return Vocab(vocab_type=message.vocab_type, bos=message.bos, eos=message.eos, add_bos=message.add_bos,
                 add_eos=message.add_eos, token_texts=tuple(message.token_texts))


def dist_to_pb(dist: SparseDist) -> pb.SparseDist:
    return pb.SparseDist(ids=dist.ids.tolist(), probs=dist.probs.tolist())


def max_chunk_bytes(entries: int) -> int:
    """The largest DraftEvent an honest draft sends with `entries` chain entries: each a token and a
    distribution of at most MAX_DIST_IDS ids (a varint of up to 5 bytes and a 4-byte float each)."""
    return entries * (MAX_DIST_IDS * 9 + 64) + 4096


# The most ids one distribution may name. An honest draft sends its top-k cap's worth (duo-draft
# --top-k-cap, 10 by default); unbounded, each entry could name the whole vocabulary (2.4 MB for
# Qwen's 151,936 ids), held for every pending position of every running session.
MAX_DIST_IDS = 1024


def dist_from_pb(message: pb.SparseDist, n_vocab: int) -> SparseDist:
    """The draft's q; ValueError saying what is wrong when it is not a distribution over the target's
    vocabulary (a draft must never make us guess)."""
    # float32 on the wire; renormalise in float64 so the rejection test uses a proper distribution.
    ids = np.asarray(message.ids, dtype=np.int64)
    probs = np.asarray(message.probs, dtype=np.float64)
    if ids.size == 0 or ids.size != probs.size:
        raise ValueError(f"a distribution has {ids.size} ids and {probs.size} probabilities")
    if ids.size > MAX_DIST_IDS:
        raise ValueError(f"a distribution names {ids.size} tokens, more than the {MAX_DIST_IDS} allowed")
    if ids.min() < 0 or ids.max() >= n_vocab:
        raise ValueError(f"a distribution names token {ids.min() if ids.min() < 0 else ids.max()}, "
                         f"outside the vocabulary of {n_vocab}")
    if np.unique(ids).size != ids.size:
        raise ValueError("a distribution names a token twice")
    if not np.all(np.isfinite(probs)) or np.any(probs < 0) or probs.sum() <= 0:
        raise ValueError("a distribution's probabilities must be finite, >= 0 and sum above 0")
    return SparseDist(ids=ids, probs=probs / probs.sum())


@dataclass(frozen=True)
class ChunkBounds:
    """What one session accepts from the draft, as the target knows it."""

    n_vocab: int      # token ids lie in [0, n_vocab)
    n_committed: int  # a new chain starts at most here
    epoch: int        # the newest epoch the session knows (chain or branch): a larger one starts a new line
    max_end: int      # no chain token at this position or beyond: the lead the target allowed, plus a margin
    live: frozenset[int]  # the epochs of the lines it holds: a chunk of an older one outside them is dropped


# Why the link drops the end of a draft's chunk (labels of duo:draft_rejected_entries_total).
REJECTION_REASONS = ("epoch", "position", "lead", "token", "distribution", "confidence", "length")


@dataclass(frozen=True)
class Rejection:
    """Why the end of a chunk was dropped."""

    reason: str   # one of REJECTION_REASONS
    detail: str   # for the log
    entries: int  # token or distribution slots dropped


def chunk_from_pb(message: pb.DraftChunk, bounds: ChunkBounds) -> tuple[ChainChunk, Rejection | None]:
    """The longest prefix of a draft's chunk that breaks no bound, and why the rest was dropped.

    A draft is a peer on another machine: a wrong model, a bug or malice must cost speculation only.
    Example: with n_vocab 100, tokens [5, 7, 300, 8] keep [5, 7]; the rejection says "token" and 2.
    What is checked costs the least first, so that no message costs more than its use: a chunk of a line
    the session dropped (a commit contradicted it; an honest draft's chunks of it may still be on the
    way) is dropped unread, and an entry at a committed position has its token checked but not its
    distribution: it is never verified.
    """
    if message.epoch <= bounds.epoch and message.epoch not in bounds.live:
        return ChainChunk(message.epoch, message.start, [], []), None
    lengths = [len(message.tokens)] + [len(entries) for entries in (message.dists, message.confidence) if entries]
    n_entries, n_paired = max(lengths), min(lengths)
    tokens: list[int] = []
    dists: list[SparseDist | None] = []
    confidences: list[float] = []
    try:
        _check_header(message, bounds)
        for i in range(n_paired):
            dist = _checked_entry(message, i, bounds)
            if message.confidence:
                confidences.append(_checked_confidence(message.confidence[i], message.start + i))
            tokens.append(message.tokens[i])
            if message.dists:
                dists.append(dist)
        if n_paired < n_entries:
            raise _Refused("length", f"{len(message.tokens)} tokens with {len(message.dists)} distributions and "
                                     f"{len(message.confidence)} confidences")
    except _Refused as refused:
        rejection = Rejection(refused.reason, str(refused), n_entries - len(tokens))
        return _chunk(message, tokens, dists, confidences), rejection
    return _chunk(message, tokens, dists, confidences), None


def _chunk(message: pb.DraftChunk, tokens: list[int], dists: list[SparseDist | None],
           confidences: list[float]) -> ChainChunk:
    branch_of = message.branch_of if message.HasField("branch_of") else None
    # A pause applies after the chunk's last token: not when the link cut the chunk short.
    paused = message.paused and len(tokens) == len(message.tokens)
    return ChainChunk(message.epoch, message.start, tokens, dists, branch_of, paused, confidences)


def max_epoch(n_committed: int) -> int:
    """The largest epoch an honest draft can have reached: it starts one per commit (a commit holds at
    least one token) and at most MAX_BRANCHES branches between two commits."""
    return (n_committed + 1) * (MAX_BRANCHES + 1)


class _Refused(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _check_header(message: pb.DraftChunk, bounds: ChunkBounds) -> None:
    if message.epoch > max_epoch(bounds.n_committed):
        raise _Refused("epoch", f"epoch {message.epoch}, but only {bounds.n_committed} tokens are committed")
    # A branch forks ahead of the committed tokens; a new chain starts from them.
    if message.epoch > bounds.epoch and message.start > bounds.n_committed and not message.HasField("branch_of"):
        raise _Refused("position", f"a new chain (epoch {message.epoch}) starting at {message.start}, beyond the "
                                   f"{bounds.n_committed} committed tokens it must be drafted on")


def _checked_entry(message: pb.DraftChunk, i: int, bounds: ChunkBounds) -> SparseDist | None:
    """Entry i's distribution (None for greedy chunks), or _Refused saying what is wrong with the entry."""
    position, token = message.start + i, message.tokens[i]
    if position >= bounds.max_end:
        raise _Refused("lead", f"a token at position {position}, beyond the lead allowed (up to {bounds.max_end})")
    if not 0 <= token < bounds.n_vocab:
        raise _Refused("token", f"token id {token}, outside the vocabulary of {bounds.n_vocab}")
    if not message.dists or position < bounds.n_committed:
        return None
    try:
        dist = dist_from_pb(message.dists[i], bounds.n_vocab)
    except ValueError as error:
        raise _Refused("distribution", str(error)) from error
    if not np.any((dist.ids == token) & (dist.probs > 0)):
        raise _Refused("distribution", f"token {token} has no probability in the distribution it was drawn from")
    return dist


def _checked_confidence(confidence: float, position: int) -> float:
    """A token's confidence as sent: a probability, else _Refused (NaN fails both comparisons)."""
    if not 0.0 <= confidence <= 1.0:
        raise _Refused("confidence", f"confidence {confidence} at position {position}, not a probability in [0, 1]")
    return confidence


def coalesce(events: list[pb.DraftEvent | None]) -> list[pb.DraftEvent | None]:
    """The same events in the same order, with each run of chunks that continue one line (same session
    and epoch, each starting where the previous ended) sent as one chunk.

    The draft drafts one token per session per round; when rounds outpace the stream (a slow link, a
    busy target reading between its decodes), their chunks queue up, and one message per token would
    cost the target a message's handling per token. A line's run is what the target would assemble
    anyway: a branch's opening chunk (branch_of) starts a new line, and a pause ends one.
    """
    merged: list[pb.DraftEvent | None] = []
    for event in events:
        previous = merged[-1] if merged else None
        if (event is not None and previous is not None and event.HasField("chunk") and previous.HasField("chunk")
                and _continues(previous.chunk, event.chunk)):
            previous.chunk.tokens.extend(event.chunk.tokens)
            previous.chunk.dists.extend(event.chunk.dists)
            previous.chunk.confidence.extend(event.chunk.confidence)
            previous.chunk.paused = event.chunk.paused
            continue
        merged.append(event)
    return merged


def _continues(line: pb.DraftChunk, chunk: pb.DraftChunk) -> bool:
    return (chunk.session_id == line.session_id and chunk.epoch == line.epoch and not line.paused
            and not chunk.HasField("branch_of") and chunk.start == line.start + len(line.tokens)
            and bool(chunk.dists) == bool(line.dists) and bool(chunk.confidence) == bool(line.confidence))
