"""llama-server's `generation_settings`: a request's sampling and limits under llama-server's names, as /completion
answers and /props (the server's defaults) show them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from duo.api.serving.request import CompletionRequest

# llama-server's "draw a random seed" (LLAMA_DEFAULT_SEED): the seed it shows where none was set.
RANDOM_SEED = 2**32 - 1


def generation_settings(request: CompletionRequest, seed: int | None = None,
                        bias: Sequence[tuple[int, float]] | None = None) -> dict[str, Any]:
    """`request`'s settings under llama-server's names; `seed` the one it ran with (the target draws one where the
    client gave none), `bias` the logit biases it ran with (texts tokenized, ignore_eos's bans: Piece.logit_bias)."""
    params, penalties = request.params, request.penalties
    bias = penalties.bias if bias is None else bias
    n_predict = 0 if request.warm_up else request.max_tokens or -1  # -1: until the end of generation or the context
    seed = seed if seed is not None else request.seed
    return {
        "seed": RANDOM_SEED if seed is None else seed, "temperature": params.temperature,
        "dynatemp_range": params.dynatemp_range, "dynatemp_exponent": params.dynatemp_exponent,
        "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p, "top_n_sigma": params.top_n_sigma,
        "xtc_probability": params.xtc_probability, "xtc_threshold": params.xtc_threshold,
        "typical_p": params.typical_p, "repeat_last_n": penalties.repeat_last_n,
        "repeat_penalty": penalties.repeat, "presence_penalty": penalties.presence,
        "frequency_penalty": penalties.frequency, "dry_multiplier": penalties.dry.multiplier,
        "dry_base": penalties.dry.base, "dry_allowed_length": penalties.dry.allowed_length,
        "dry_penalty_last_n": penalties.dry.penalty_last_n, "dry_sequence_breakers": list(penalties.dry.breakers),
        "mirostat": params.mirostat, "mirostat_tau": params.mirostat_tau, "mirostat_eta": params.mirostat_eta,
        # duo has no adaptive-p sampler: llama-server's values for it off
        "adaptive_target": -1.0, "adaptive_decay": 0.9,
        "stop": list(request.stop), "max_tokens": n_predict, "n_predict": n_predict,
        "ignore_eos": request.ignore_eos, "n_probs": max(request.logprobs, 0), "min_keep": params.min_keep,
        # a bias of -inf (never) is null, as llama-server's JSON writes it
        "logit_bias": [{"bias": bias if math.isfinite(bias) else None, "token": token}
                       for token, bias in bias],
        "timings_per_token": False, "post_sampling_probs": request.post_sampling_probs,
    }
