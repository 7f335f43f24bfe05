"""Conversions between the protobuf messages of proto/duo.proto and duo's own types."""

from __future__ import annotations

import numpy as np

from duo._proto import duo_pb2 as pb
from duo.model import Vocab
from duo.sampling import SamplingParams, SparseDist

PROTOCOL = "duo/1"


def sampling_to_pb(params: SamplingParams, seed: int | None) -> pb.SamplingParams:
    message = pb.SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                top_p=params.top_p, min_p=params.min_p)
    if seed is not None:
        message.seed = seed
    return message


def sampling_from_pb(message: pb.SamplingParams) -> tuple[SamplingParams, int | None]:
    """The params and the seed (None when unset); top_p 0 means an unset field, i.e. 1."""
    params = SamplingParams(temperature=float(message.temperature), top_k=int(message.top_k),
                            top_p=float(message.top_p) or 1.0, min_p=float(message.min_p))
    return params, (message.seed if message.HasField("seed") else None)


def vocab_to_pb(vocab: Vocab) -> pb.Vocab:
    return pb.Vocab(vocab_type=vocab.vocab_type, bos=vocab.bos, eos=vocab.eos, add_bos=vocab.add_bos,
                    add_eos=vocab.add_eos, token_texts=list(vocab.token_texts))


def vocab_from_pb(message: pb.Vocab) -> Vocab:
    return Vocab(vocab_type=message.vocab_type, bos=message.bos, eos=message.eos, add_bos=message.add_bos,
                 add_eos=message.add_eos, token_texts=tuple(message.token_texts))


def dist_to_pb(dist: SparseDist) -> pb.SparseDist:
    return pb.SparseDist(ids=dist.ids.tolist(), probs=dist.probs.tolist())


def dist_from_pb(message: pb.SparseDist) -> SparseDist:
    """The draft's q; ValueError when it is not a distribution (a draft must never make us guess)."""
    # float32 on the wire; renormalise in float64 so the rejection test uses a proper distribution.
    probs = np.asarray(message.probs, dtype=np.float64)
    if len(message.ids) != probs.size or not np.all(np.isfinite(probs)) or np.any(probs < 0) or probs.sum() <= 0:
        raise ValueError("a draft distribution needs as many ids as probabilities, finite, >= 0, summing above 0")
    return SparseDist(ids=np.asarray(message.ids, dtype=np.int64), probs=probs / probs.sum())
