"""Errors in OpenAI's shape ({"error": {"message", "type", "param", "code"}}), as duo's OpenAI and llama-server routes
answer them, the HTTP status each kind of failure gets, and how a protocol writes an error (ErrorShape)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse, Response

from duo.api.serving.admit import QueueFull
from duo.api.serving.generate import failure_message, request_fault
from duo.api.serving.request import BadRequest, ClientError, NotReady, ShuttingDown


class ApiError(Exception):
    """An error a route answers: its HTTP status and headers, its message and OpenAI's fields (type, param, code);
    each protocol's ErrorShape writes it in its own shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type, param, code, headers
        self.details = details or {}  # more of the error's fields (they may name another type: llama-server's)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code,
                          **self.details}}


# How a protocol writes an error as an HTTP answer: error_response here, duo.api.anthropic.errors.error_response there.
ErrorShape = Callable[[ApiError], Response]


def error_response(error: ApiError) -> Response:
    """OpenAI's shape (llama-server's too): ApiError.body() as JSON."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def server_error(message: str) -> ApiError:
    return ApiError(500, message, type="server_error")


def generation_error(error: Exception) -> ApiError:
    """A request that failed while generating: a 400 where the request itself is at fault, else a 500."""
    message = failure_message(error)
    return ApiError(400, message, code="invalid_request") if request_fault(error) else server_error(message)


def api_error(error: ClientError | QueueFull) -> ApiError:
    if isinstance(error, BadRequest):
        return ApiError(400, str(error), param=error.param, code=error.code, details=error.details)
    if isinstance(error, QueueFull):
        return ApiError(503, str(error), type="server_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(error, ShuttingDown):
        return ApiError(503, str(error), type="server_error", code="shutting_down")
    assert isinstance(error, NotReady), error  # the last kind of ClientError
    return ApiError(503, str(error), type="server_error", code="model_loading", headers={"Retry-After": "1"})
