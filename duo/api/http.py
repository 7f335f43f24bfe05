"""The target's OpenAI-compatible HTTP endpoint (FastAPI): completions, chat, models, health and metrics."""

from __future__ import annotations

import asyncio
import copy
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from duo.api.admission import QueueFull
from duo.api.answers import (ApiError, ChatFormat, CompletionFormat, NativeFormat, ResponseFormat, api_error,
                             generation_error, server_error)
from duo.api.bodies import ChatBody, CompletionBody, GenerationBody, template_messages
from duo.api.choices import (Choices, choice_requests, collect, collect_all, merged_events, start_choices,
                             whole_answer)
from duo.api.completion import Completion, Completions, failure_message
from duo.api.metrics import CONTENT_TYPE, Metrics
from duo.api.native import ApplyTemplateBody, DetokenizeBody, InfillBody, NativeCompletionBody, TokenizeBody
from duo.api.parsing import document_bodies, parse_body
from duo.api.requests import ClientError, CompletionRequest, ShuttingDown
from duo.model import ModelError
from duo.runtime import WRITE_TIMEOUT_S, HttpServer, WriteTimeout, within, write_within

log = logging.getLogger("duo.http")

T = TypeVar("T")

# A request body must arrive within this long (a client trickling bytes would hold a connection forever).
BODY_READ_TIMEOUT_S = 30.0
# Connections served at once; beyond, uvicorn answers 503 (generations are bounded by --parallel/--queue-size).
MAX_HTTP_CONNECTIONS = 256
# nginx's "client closed request": logged for requests whose client left before the answer.
CLIENT_CLOSED = 499
NATIVE_PATHS = frozenset({"/completion", "/completions", "/infill", "/tokenize", "/detokenize", "/apply-template",
                          "/props"})


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


class BodyLimit:
    """Before any body is read: refuses /v1/* without the API key (401); then refuses bodies over
    `max_bytes` (413) without reading them into memory, and bodies that take longer than
    `read_timeout` to arrive (408)."""

    def __init__(self, app: ASGIApp, max_bytes: Callable[[], int], api_key: str | None,
                 read_timeout: float = BODY_READ_TIMEOUT_S) -> None:
        self.app = app
        self.limit = max_bytes  # what the model's context can use: known once it is loaded
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected and _needs_key(scope["path"]) and not hmac.compare_digest(
                headers.get(b"authorization", b""), self.expected):
            return await _wrong_key().response()(scope, receive, send)
        length, max_bytes = headers.get(b"content-length", b"0"), self.limit()
        if length.isdigit() and int(length) > max_bytes:
            return await self._too_large(max_bytes).response()(scope, receive, send)
        received, complete = 0, False
        deadline = asyncio.get_running_loop().time() + self.read_timeout

        async def limited() -> Message:
            nonlocal received, complete
            if complete:  # later receives wait for the client to leave: no deadline
                return await receive()
            try:
                message = await within(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.read_timeout:g} s") from None
            received += len(message.get("body", b""))
            complete = not message.get("more_body", False)
            if received > max_bytes:
                raise HTTPException(413, str(self._too_large(max_bytes)))
            return message

        await self.app(scope, limited, send)

    def _too_large(self, max_bytes: int) -> ApiError:
        return ApiError(413, f"the request body is larger than {max_bytes} bytes, more than the model's context "
                             "can use")


class EventStream(StreamingResponse):
    """Server-sent events that close their completion whatever happens to the connection, which frees
    the request's running place and its sessions on the target and the draft. A client that takes no
    event for `write_timeout` seconds (its socket buffers stayed full) is dropped."""

    def __init__(self, events: AsyncIterator[str], completion: Completion | Choices, *, write_timeout: float,
                 on_timeout: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events = events
        self.completion = completion
        self.write_timeout = write_timeout
        self.on_timeout = on_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_within_timeout(message: Message) -> None:
            await write_within(send(message), self.write_timeout)

        try:
            await super().__call__(scope, receive, send_within_timeout)
        except WriteTimeout as error:
            # ASGI cannot abort a response; returning before its end makes uvicorn close the connection.
            host, port = scope.get("client") or ("?", 0)
            log.warning("dropped client %s:%s: %s", host, port, error)
            self.on_timeout()
        finally:
            # The events first: a stream left suspended (a write timeout, a client gone mid-send) still iterates
            # its completion, which cannot be closed while it does.
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
            await self.completion.aclose()


async def until_disconnected(request: Request) -> None:
    """Return once the client has closed the connection (its body was read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left, or this handler was cancelled (the server stops): so does the work
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone()
    return task.result()


class OpenAIApi:
    """The routes, bound to the target's Completions."""

    def __init__(self, completions: Completions, metrics: Metrics, write_timeout: float) -> None:
        self.completions = completions
        self.metrics = metrics
        self.write_timeout = write_timeout

    def health(self) -> JSONResponse:
        completions = self.completions
        link = completions.target.link if completions.target else None
        status = "shutting down" if completions.closing else "ok" if completions.target else "loading"
        body = {"status": status, "model": completions.names[0],
                "draft": completions.draft_state, "draft_error": link.last_error if link else "",
                "draft_sessions": len(link.sessions) if link else 0,
                "requests_running": completions.admission.running,
                "requests_waiting": completions.admission.waiting}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card(name) for name in self.completions.names]}

    def model(self, model_id: str) -> dict[str, Any]:
        self.completions.check_model(model_id)
        return self._model_card(model_id)

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "duo"}

    async def completion(self, request: Request) -> Response:
        body = await parse_body(await request.body(), CompletionBody, self.completions.body_limits())
        return await self._generate(body, body.to_request, request, CompletionFormat(self._name(body)))

    async def chat(self, request: Request) -> Response:
        body = await parse_body(await request.body(), ChatBody, self.completions.body_limits())
        functions = body.callable_functions()
        return await self._generate(body, body.to_request, request,
                                    ChatFormat(self._name(body), functions,
                                               self.completions.call_format() if functions else None))

    # llama-server's native endpoints, as scripts written for llama.cpp call them.
    async def native_completion(self, request: Request) -> Response:
        return await self._native(request, NativeCompletionBody)

    async def infill(self, request: Request) -> Response:
        return await self._native(request, InfillBody)

    async def _native(self, request: Request, kind: type[NativeCompletionBody]) -> Response:
        body = await parse_body(await request.body(), kind, self.completions.body_limits())
        output = NativeFormat(self._name(body), body.response_fields)
        if body.warm_up:  # nothing to generate: the answer an editor's warm-up waits for
            body.check_supported()  # its fields are checked all the same
            return JSONResponse(output.fields({"content": "", "tokens": [], "stop": True, "model": output.model,
                                               "stop_type": "limit", "tokens_predicted": 0}))
        return await self._generate(body, body.to_request, request, output)

    async def tokenize(self, request: Request) -> dict[str, Any]:
        body = await parse_body(await request.body(), TokenizeBody, self.completions.body_limits())
        body.check_fields()
        self.completions.check_text_size(body.content, "content")
        model = self.completions.loaded_model()

        def tokens() -> list[int] | list[dict[str, Any]]:  # on a worker thread: long texts take a while
            ids = model.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
            if not body.with_pieces:
                return ids
            return [{"id": token, "piece": _piece(model.token_piece(token, special=True))} for token in ids]

        return {"tokens": await self.completions.tokenizing(tokens)}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        body = await parse_body(await request.body(), DetokenizeBody, self.completions.body_limits())
        body.check_fields()
        model = self.completions.loaded_model()

        def text() -> str:  # on a worker thread, the range check too: a context's worth of ids (of any size)
            if body.tokens and not (min(body.tokens) >= 0 and max(body.tokens) < model.n_vocab):
                raise ApiError(400, f"token ids must be between 0 and {model.n_vocab - 1}", param="tokens")
            return model.detokenize(body.tokens).decode(errors="replace")

        return {"content": await self.completions.tokenizing(text)}

    async def apply_template(self, request: Request) -> dict[str, Any]:
        body = await parse_body(await request.body(), ApplyTemplateBody, self.completions.body_limits())
        body.check_fields()
        model = self.completions.loaded_model()
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        return {"prompt": await self.completions.tokenizing(model.chat_prompt, template_messages(body.messages),
                                                            tools)}

    def props(self) -> dict[str, Any]:
        completions = self.completions
        model = completions.loaded_model()
        return {"model_alias": completions.names[0], "model_path": str(model.path),
                "total_slots": completions.admission.parallel, "chat_template": model.chat_template(),
                "default_generation_settings": {"n_ctx": completions.context_size},
                "modalities": {"vision": False, "audio": False}, "build_info": "duo",
                "duo": {"draft": completions.draft_state}}

    def _name(self, body: GenerationBody) -> str:
        self.completions.check_model(body.model)
        return body.model or self.completions.names[0]

    async def _generate(self, body: GenerationBody, to_request: Callable[[], CompletionRequest], request: Request,
                        output: ResponseFormat | NativeFormat) -> Response:
        n = body.choice_count(self.completions.admission.parallel)
        formats = [output] + [copy.deepcopy(output) for _ in range(n - 1)]  # each choice's own, one answer's id
        wanted = await asyncio.to_thread(to_request)  # a loop over the client's biases, tools and messages
        try:
            completion: Completion | Choices = await unless_disconnected(request, self.completions.start(
                wanted) if n == 1 else start_choices(self.completions, choice_requests(wanted, n)))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        if body.stream:
            events = output.events(completion, body.include_usage) if isinstance(completion, Completion) \
                else merged_events(formats, completion, body.include_usage)
            return EventStream(events, completion, write_timeout=self.write_timeout,
                               on_timeout=self.metrics.client_write_timeouts.inc)
        async with aclosing(completion):
            try:
                pieces = await unless_disconnected(request, collect(completion) if isinstance(completion, Completion)
                                                   else collect_all(completion))
            except ClientGone:
                return Response(status_code=CLIENT_CLOSED)
            except ShuttingDown as error:
                return api_error(error).response()
            except Exception as error:  # this request's own failure: it alone ends, in OpenAI's shape
                return generation_error(error).response()
        return JSONResponse(output.whole(pieces) if isinstance(completion, Completion)
                            else whole_answer(formats, pieces))


def create_app(completions: Completions, metrics: Metrics, api_key: str | None, *,
               write_timeout: float = WRITE_TIMEOUT_S) -> ASGIApp:
    """The FastAPI app; /v1/* needs `Authorization: Bearer <api_key>` when a key is set, /health and /metrics never.
    A streaming client that takes no event for `write_timeout` seconds is dropped."""
    api = OpenAIApi(completions, metrics, write_timeout)
    # No /docs or /redoc: they load their scripts from a CDN. /openapi.json describes the API.
    app = FastAPI(title="duo-target", docs_url=None, redoc_url=None, strict_content_type=False)
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics_text, methods=["GET"])
    v1 = APIRouter(prefix="/v1")  # BodyLimit checks the key, before any body is read
    v1.add_api_route("/models", api.models, methods=["GET"])
    v1.add_api_route("/models/{model_id}", api.model, methods=["GET"])
    v1.add_api_route("/completions", api.completion, methods=["POST"])
    v1.add_api_route("/chat/completions", api.chat, methods=["POST"])
    app.include_router(v1)
    app.add_api_route("/completion", api.native_completion, methods=["POST"])
    app.add_api_route("/completions", api.native_completion, methods=["POST"])
    app.add_api_route("/infill", api.infill, methods=["POST"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/apply-template", api.apply_template, methods=["POST"])
    app.add_api_route("/props", api.props, methods=["GET"])
    document_bodies(app, {"/v1/completions": CompletionBody, "/v1/chat/completions": ChatBody,
                          "/completion": NativeCompletionBody, "/completions": NativeCompletionBody,
                          "/infill": InfillBody,
                          "/tokenize": TokenizeBody, "/detokenize": DetokenizeBody,
                          "/apply-template": ApplyTemplateBody})
    add_error_handlers(app)
    return BodyLimit(app, completions.max_body_bytes, api_key)


def _needs_key(path: str) -> bool:
    """/v1/* and llama-server's native endpoints need the API key; /health, /metrics and /openapi.json do not."""
    return path.startswith("/v1/") or path in NATIVE_PATHS


def _wrong_key() -> ApiError:
    return ApiError(401, "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                    code="invalid_api_key")


def add_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    async def on_client_error(request: Request, error: Exception) -> JSONResponse:
        return api_error(error).response()  # type: ignore[arg-type]

    async def on_failure(request: Request, error: Exception) -> JSONResponse:
        return server_error(failure_message(error)).response()

    async def on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_message(error).response()

    async def on_http_error(request: Request, error: HTTPException) -> JSONResponse:
        if error.status_code in (404, 405):
            return ApiError(error.status_code, f"{request.method} {request.url.path} is not part of this API "
                                               "(see /openapi.json)").response()
        return ApiError(error.status_code, str(error.detail)).response()

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(ClientError, on_client_error)
    app.add_exception_handler(QueueFull, on_client_error)
    app.add_exception_handler(ModelError, on_failure)
    app.add_exception_handler(Exception, on_failure)  # the last resort: a 500 in OpenAI's shape, never plain text
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)


def http_server(app: ASGIApp, *, tls_cert: str | None, tls_key: str | None, debug: bool) -> HttpServer:
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=debug, ssl_certfile=tls_cert,
                            ssl_keyfile=tls_key, timeout_graceful_shutdown=2, limit_concurrency=MAX_HTTP_CONNECTIONS)
    return HttpServer(config)


def _piece(text: bytes) -> str | list[int]:
    """A token's text for /tokenize's pieces: the string, or its bytes where they are not whole UTF-8 (as
    llama-server)."""
    try:
        return text.decode()
    except UnicodeDecodeError:
        return list(text)
