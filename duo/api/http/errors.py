"""Which protocol's shape an HTTP error answer takes, chosen by its path: Anthropic's on the Messages API's paths,
OpenAI's (llama-server's is the same) everywhere else."""

from __future__ import annotations

from fastapi.responses import Response

from duo.api.anthropic import errors as anthropic
from duo.api.openai import errors as openai
from duo.api.openai.errors import ApiError, ErrorShape


def error_shape(path: str) -> ErrorShape:
    """By the path, not the route: a path under the Messages API's that no route serves (a 404) and a request the
    gate or CORS refuses before any route is chosen are answered in the shape its client reads."""
    return anthropic.error_response if path.startswith(anthropic.PATH_PREFIX) else openai.error_response


def error_response(path: str, error: ApiError) -> Response:
    return error_shape(path)(error)
