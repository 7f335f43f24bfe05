"""Committed tokens' log-probabilities as the answers show them: each token's text, bytes and log-probability, and
its top alternatives'; then in OpenAI's chat, OpenAI's legacy completions and llama-server's shapes."""

from __future__ import annotations

import math
from typing import Any, Protocol, Sequence


class Pieces(Protocol):
    def token_piece(self, token: int, *, special: bool = False) -> bytes: ...


TokenLogprobs = tuple[float, list[tuple[int, float]]]


def described(model: Pieces, tokens: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
    """One entry per token: id, text, bytes, logprob and `top` (the alternatives, described alike)."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        piece = model.token_piece(token, special=True)
        return {"id": token, "token": piece.decode(errors="replace"), "bytes": list(piece), "logprob": logprob}

    return [{**one(token, logprob), "top": [one(other, value) for other, value in top]}
            for token, (logprob, top) in zip(tokens, logprobs)]


def chat_logprobs(entries: list[dict[str, Any]], post_sampling: bool = False) -> dict[str, Any]:
    """OpenAI chat's choice.logprobs; after the sampler chain (llama-server's post_sampling_probs), its shape of them:
    each token's probability (prob) and its alternatives' (top_probs)."""
    if post_sampling:
        return {"content": native_probabilities(entries, post_sampling)}

    def item(entry: dict[str, Any]) -> dict[str, Any]:
        return {"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"]}

    return {"content": [{**item(e), "top_logprobs": [item(t) for t in e["top"]]} for e in entries]}


def completion_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs; `offset`: the text's length before these tokens."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for e in entries], "text_offset": offsets}


def native_probabilities(entries: list[dict[str, Any]], post_sampling: bool = False) -> list[dict[str, Any]]:
    """llama-server's completion_probabilities (n_probs): log-probabilities (logprob, top_logprobs), or after the
    sampler chain (post_sampling_probs) probabilities (prob, top_probs), as llama-server names them."""
    def item(entry: dict[str, Any]) -> dict[str, Any]:
        shown = {"id": entry["id"], "token": entry["token"], "bytes": entry["bytes"]}
        return shown | ({"prob": math.exp(entry["logprob"])} if post_sampling else {"logprob": entry["logprob"]})

    top = "top_probs" if post_sampling else "top_logprobs"
    return [{**item(e), top: [item(t) for t in e["top"]]} for e in entries]
