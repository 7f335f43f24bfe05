"""The target's HTTP app (FastAPI): its routes, its error handlers, and the server that runs it."""

from __future__ import annotations

from collections.abc import Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp

from duo.api.serving.admit import QueueFull
from duo.api.openai.errors import ApiError, api_error, server_error
from duo.api.http.errors import error_response
from duo.api.serving.generate import Completions, failure_message
from duo.api.http.gate import Cors, Gate
from duo.api.http.anthropic import add_messages_routes
from duo.api.http.answering import Answering
from duo.api.http.launch import LaunchSettings
from duo.api.http.llama_server import add_llama_server_routes
from duo.api.http.openai import add_openai_routes
from duo.api.http.responses import add_responses_routes
from duo.api.serving.metrics import Metrics
from duo.api.page import add_page_routes
from duo.api.serving.request import ClientError
from duo.llama.model import ModelError
from duo.net.listening import HttpServer
from duo.net.timeouts import WRITE_TIMEOUT_S

# Connections served at once; beyond, uvicorn answers 503 (generations are bounded by --parallel/--queue-size).
MAX_HTTP_CONNECTIONS = 256


def validation_message(error: RequestValidationError) -> ApiError:
    """FastAPI's 422 as a 400 whose message names the field (or says the body is not JSON)."""
    first = error.errors()[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON: {detail}".rstrip(": "))
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    field = ".".join(where)
    if not field:
        return ApiError(400, "the request body must be a JSON object, sent with the header "
                             "`Content-Type: application/json`")
    return ApiError(400, f"{field}: {first.get('msg', 'invalid value')}", param=field)



def create_app(completions: Completions, metrics: Metrics, api_key: str | None, *,
               write_timeout: float = WRITE_TIMEOUT_S, cors_origins: Sequence[str] | None = None,
               launch: LaunchSettings = LaunchSettings()) -> ASGIApp:
    """The app: every route but the public ones (duo.api.http.gate) needs the key when one is set; CORS as
    llama-server's, narrowed to `cors_origins` where given (duo.api.http.gate.Cors: other origins refused, private
    network access only behind the list or the key). A streaming client that takes no event for `write_timeout`
    seconds is dropped. `launch`: what llama-server's launch flags set (duo.api.http.launch)."""
    answering = Answering(completions, metrics, write_timeout, launch.defaults)
    # No /docs or /redoc: they load their scripts from a CDN. /openapi.json describes the API.
    app = FastAPI(title="duo-target", docs_url=None, redoc_url=None, strict_content_type=False)
    add_llama_server_routes(app, answering, slots=launch.slots, metrics=launch.metrics)
    add_openai_routes(app, answering, aliases=launch.aliases, tags=launch.tags)
    add_responses_routes(app, answering)
    add_messages_routes(app, answering)
    add_page_routes(app)  # the chat page at /, as llama-server's
    answer_head_as_get(app)
    add_error_handlers(app)
    return Cors(Gate(app, completions.max_body_bytes, api_key), cors_origins, keyed=bool(api_key))


def answer_head_as_get(app: FastAPI) -> None:
    """HEAD on every GET route, as llama-server's HTTP server answers it (the headers of the GET, no body): Claude
    Code's first request is a HEAD of its base URL, to warm the connection."""
    for route in app.routes:
        if isinstance(route, APIRoute) and "GET" in route.methods:
            route.methods.add("HEAD")


def add_error_handlers(app: FastAPI) -> None:
    """Every error answered in the shape of the protocol its path speaks (duo.api.http.errors), never plain text."""
    async def on_api_error(request: Request, error: ApiError) -> Response:
        return error_response(request.scope["path"], error)

    async def on_client_error(request: Request, error: Exception) -> Response:
        return error_response(request.scope["path"], api_error(error))  # type: ignore[arg-type]

    async def on_failure(request: Request, error: Exception) -> Response:
        return error_response(request.scope["path"], server_error(failure_message(error)))

    async def on_validation_error(request: Request, error: RequestValidationError) -> Response:
        return error_response(request.scope["path"], validation_message(error))

    async def on_http_error(request: Request, error: HTTPException) -> Response:
        if error.status_code in (404, 405):
            return error_response(request.scope["path"], ApiError(
                error.status_code, f"{request.method} {request.url.path} is not part of this API (see /openapi.json)"))
        return error_response(request.scope["path"], ApiError(error.status_code, str(error.detail)))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(ClientError, on_client_error)
    app.add_exception_handler(QueueFull, on_client_error)
    app.add_exception_handler(ModelError, on_failure)
    app.add_exception_handler(Exception, on_failure)  # the last resort: a 500 in the protocol's shape
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)


def http_server(app: ASGIApp, *, tls_cert: str | None, tls_key: str | None, debug: bool) -> HttpServer:
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=debug, ssl_certfile=tls_cert,
                            ssl_keyfile=tls_key, timeout_graceful_shutdown=2, limit_concurrency=MAX_HTTP_CONNECTIONS)
    return HttpServer(config)


