"""The server's own sampling defaults (llama-server's --temp, --seed, -n, ...): what a body that leaves a field out gets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from duo.api.serving.bodies import GenerationBody

# The body field that llama-server's -n/--n-predict sets: the token limit of a body that names none of its limits.
TOKEN_LIMIT = "n_predict"

# llama-server's own sampling defaults (common_params_sampling in llama.cpp's common.h: temp 0.80, top_k 40, top_p
# 0.95, min_p 0.05), which its /props reports and every body that leaves these fields out samples with, on each of its
# APIs (an OpenAI, Anthropic or Responses body read as its chat). OpenAI's own API would sample at temperature 1,
# untruncated; a drop-in for llama-server samples as llama-server does. The launch line's --temp, --top-k, --top-p
# and --min-p replace them.
LLAMA_SERVER_SAMPLING: Mapping[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


@dataclass(frozen=True)
class ServerDefaults:
    """Body fields (GenerationBody's names) and the server's values for them: the launch line's over llama-server's
    own sampling defaults (LLAMA_SERVER_SAMPLING). A body's own field wins; one it leaves out or sends as null takes
    the server's, as llama-server reads its fields (json_value: absent or null is the default)."""

    fields: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", {**LLAMA_SERVER_SAMPLING, **self.fields})

    def fill(self, body: GenerationBody) -> None:
        """Give `body` the server's value of every field it left out (fields its kind does not have are skipped:
        reasoning_format is chat's)."""
        for name, value in self.fields.items():
            if name not in type(body).model_fields or not self._left_out(body, name):
                continue
            setattr(body, name, value)

    @staticmethod
    def _left_out(body: GenerationBody, name: str) -> bool:
        if name == TOKEN_LIMIT:  # -n is the limit of a body that sets none: max_tokens and its aliases win
            return all(getattr(body, limit) is None or limit not in body.model_fields_set
                       for limit in (*body.LIMIT_NAMES, TOKEN_LIMIT))
        return name not in body.model_fields_set or getattr(body, name) is None
