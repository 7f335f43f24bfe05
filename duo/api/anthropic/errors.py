"""Errors in Anthropic's shape for the Messages API's paths: {"type": "error", "error": {"type", "message"}}, with
the HTTP status duo gives the same error on its other routes."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response

from duo.api.openai.errors import ApiError

# Anthropic's error types by HTTP status; any other 4xx is an invalid request, any other 5xx an api_error.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}
# The Messages API's paths (/v1/messages, /v1/messages/count_tokens) and whatever is asked for under them.
PATH_PREFIX = "/v1/messages"


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_response(error: ApiError) -> Response:
    """`error` in Anthropic's shape (an ErrorShape), its status and headers (Retry-After) kept; OpenAI's other fields
    (param, code) have no place in it. Written by json.dumps, spaced as these answers have always been (FastAPI's
    JSONResponse writes JSON without spaces)."""
    body = json.dumps(error_body(error.status, str(error)), ensure_ascii=False).encode()
    return Response(body, status_code=error.status, headers=error.headers, media_type="application/json")
