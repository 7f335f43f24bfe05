"""The server's own sampling defaults (llama-server's --temp, --seed, -n, ...): what a body that leaves a field out gets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from duo.api.serving.bodies import GenerationBody

# The body field that llama-server's -n/--n-predict sets: the token limit of a body that names none of its limits.
TOKEN_LIMIT = "n_predict"


@dataclass(frozen=True)
class ServerDefaults:
    """Body fields (GenerationBody's names) and the values the launch line gave them. A body's own field wins; one it
    leaves out or sends as null takes the server's, as llama-server reads its fields (json_value: absent or null is
    the default)."""

    fields: Mapping[str, Any] = field(default_factory=dict)

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
