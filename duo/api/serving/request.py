"""A client's request as duo reads it, whatever its transport, and the errors a request can get."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from duo.api.output.deltas import ReasoningFormat
from duo.api.serving.infill import FimInput
from duo.api.serving.limits import MAX_STOP_STRINGS
from duo.api.tools import ToolUse
from duo.constraint import GrammarSpec
from duo.sampling.ops.penalties import Penalties
from duo.sampling.params import SamplingParams


class ClientError(Exception):
    """A request that cannot be served now; the message says why and what to do."""


class BadRequest(ClientError):
    """The request itself is wrong; `param` names the field to fix where there is one."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.details = dict(details or {})  # more fields of the error object (a context overflow's sizes)


class NotReady(ClientError):
    """The model is still loading."""


class ShuttingDown(NotReady):
    """duo-target is stopping: no new request, and a running one that outlives the grace period ends."""


@dataclass(frozen=True)
class CompletionRequest:
    """A request as a client sent it; exactly one of prompt, messages, prompt_tokens is used."""

    prompt: str = ""
    messages: Sequence[Mapping[str, Any]] = ()  # rendered with the model's chat template
    prefill: str | None = None                 # chat: the assistant's text the prompt ends with (duo.api.serving.prefill)
    chat: bool = False                         # the chat template renders the prompt, even of no message at all
    generation_prompt: bool = True             # chat: the template's add_generation_prompt
    # A prompt already tokenized (an empty one is refused); llama-server's texts among the ids are tokenized in place.
    prompt_tokens: Sequence[int | str] | None = None
    max_tokens: int = 0                        # 0: until end of generation or a full context
    params: SamplingParams = SamplingParams()
    seed: int | None = None
    stop: Sequence[str] = ()
    cache_prompt: bool = True                  # false: no prompt prefix shared with other requests
    grammar: GrammarSpec | None = None         # the output must match it (duo.constraint)
    tool_use: ToolUse | None = None            # chat: the tools the template renders, and whether a call is due
    reasoning_format: ReasoningFormat = "deepseek"  # chat: how reasoning is told from content (duo.api.output.deltas)
    chat_template_kwargs: Mapping[str, Any] | None = None  # chat: more variables for the template (enable_thinking)
    penalties: Penalties = Penalties()         # presence, frequency and repeat penalties, logit_bias
    bias_texts: tuple[tuple[str, float], ...] = ()  # logit_bias given as text: each of its tokens gets the bias
    logprobs: int = -1                         # >= 0: each token's logprob and this many alternatives'
    post_sampling_probs: bool = False          # llama-server's: those after the whole sampler chain
    fim: FimInput | None = None                # fill-in-the-middle: the prompt is built around the hole
    infill_sampler: bool = False               # llama.cpp's infill sampler after the truncations
    n_indent: int = 0                          # llama-server's code-completion stop rules (duo.api.serving.infill)
    t_max_predict_ms: int = 0
    ignore_eos: bool = False                   # llama-server's: the end-of-generation tokens are never drawn
    warm_up: bool = False                      # read the prompt into the cache; the answer drops what follows
    progress: bool = False                     # a stream tells how far the prompt's read got (return_progress)
    arrived: float = field(default_factory=time.monotonic)


def rendered_chat(request: CompletionRequest) -> bool:
    """Whether the chat template renders `request`'s prompt: a chat (as llama-server, one of no message too), messages
    or a prefill."""
    return request.chat or bool(request.messages) or request.prefill is not None


def too_long(message: str, *, n_prompt_tokens: int, n_ctx: int, param: str = "prompt") -> BadRequest:
    """A prompt that cannot fit the context, in llama-server's shape (type exceed_context_size_error, its sizes,
    its words, which clients look for to shorten and retry) and OpenAI's (code context_length_exceeded).
    `n_prompt_tokens` is a lower bound where the prompt was refused before it was tokenized."""
    return BadRequest(f"request ({n_prompt_tokens} tokens) exceeds the available context size ({n_ctx} tokens): "
                      f"{message}; shorten the prompt or start duo-target with a larger --ctx-size", param=param,
                      code="context_length_exceeded", details={"type": "exceed_context_size_error",
                                                               "n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx})


def check_stops(stops: Sequence[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", param="stop")
    if any(not stop for stop in stops):
        raise BadRequest("stop strings must not be empty", param="stop")
