"""The routes of the target's HTTP API, bound to its Completions: OpenAI's completions, chat and models,
llama-server's native endpoints, health and metrics."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from duo.api.llama_server.answer import NativeFormat
from duo.api.openai.answers import AnswerShape, ChatFormat, CompletionFormat
from duo.api.openai.bodies import ChatBody, CompletionBody, template_messages
from duo.api.openai.errors import ApiError, api_error, generation_error
from duo.api.serving.bodies import GenerationBody
from duo.api.serving.choices import (Choices, choice_requests, collect, collect_all, merged_events, start_choices,
                                     whole_answer)
from duo.api.serving.generate import Completion, Completions
from duo.api.http.streams import CLIENT_CLOSED, ClientGone, EventStream, unless_disconnected
from duo.api.serving.metrics import CONTENT_TYPE, Metrics
from duo.api.llama_server.bodies import ApplyTemplateBody, DetokenizeBody, InfillBody, NativeCompletionBody, TokenizeBody
from duo.api.serving.read import parse_body
from duo.api.serving.request import CompletionRequest, ShuttingDown


class OpenAIApi:
    """The routes, bound to the target's Completions."""

    def __init__(self, completions: Completions, metrics: Metrics, write_timeout: float) -> None:
        self.completions = completions
        self.metrics = metrics
        self.write_timeout = write_timeout

    def health(self) -> JSONResponse:
        completions = self.completions
        pool = completions.target.pool if completions.target else None
        status = "shutting down" if completions.closing else "ok" if completions.target else "loading"
        body = {"status": status, "model": completions.names[0],
                "draft": completions.draft_state, "draft_error": pool.last_error if pool else "",
                "draft_sessions": len(pool.home) if pool else 0, "drafts": completions.drafts(),
                "requests_running": completions.admission.running,
                "requests_waiting": completions.admission.waiting}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card(name) for name in self.completions.names]}

    def model(self, model_id: str) -> dict[str, Any]:
        """Any name is this server's one model (as llama-server serves whatever `model` a request names)."""
        return self._model_card(model_id)

    def _model_card(self, name: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "duo"}
        if self.completions.target is not None:  # llama-server's meta: clients size their prompts by n_ctx_train
            card["meta"] = self.completions.target.model.meta()
        return card

    def slots(self) -> list[dict[str, Any]]:
        """llama-server's /slots, read-only: duo's running places (--parallel), those at work first."""
        completions = self.completions
        admission = completions.admission
        return [{"id": slot, "n_ctx": completions.context_size, "is_processing": slot < admission.running,
                 "speculative": completions.draft_connected} for slot in range(admission.parallel)]

    async def completion(self, request: Request) -> Response:
        body = await parse_body(await request.body(), CompletionBody, self.completions.body_limits())
        return await self.generate(body, body.to_request, request,
                                   CompletionFormat(self._name(body), sources=body.duo_sources))

    async def chat(self, request: Request) -> Response:
        body = await parse_body(await request.body(), ChatBody, self.completions.body_limits())
        functions = body.callable_functions()
        # The template's format even without functions: it says how the model marks its reasoning.
        return await self.generate(body, body.to_request, request,
                                   ChatFormat(self._name(body), functions, self.completions.call_format(),
                                              sources=body.duo_sources))

    # llama-server's native endpoints, as scripts written for llama.cpp call them.
    async def native_completion(self, request: Request) -> Response:
        return await self._native(request, NativeCompletionBody)

    async def infill(self, request: Request) -> Response:
        return await self._native(request, InfillBody)

    async def _native(self, request: Request, kind: type[NativeCompletionBody]) -> Response:
        body = await parse_body(await request.body(), kind, self.completions.body_limits())
        output = NativeFormat(self._name(body), body.response_fields)
        return await self.generate(body, body.to_request, request, output)

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

        def prompt() -> str:  # on a worker thread: a loop over the client's messages and tools
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
            return model.chat_prompt(template_messages(body.messages), tools)

        return {"prompt": await self.completions.tokenizing(prompt)}

    def props(self) -> dict[str, Any]:
        completions = self.completions
        model = completions.loaded_model()
        return {"model_alias": completions.names[0], "model_path": str(model.path),
                "total_slots": completions.admission.parallel, "chat_template": model.chat_template(),
                "default_generation_settings": {"n_ctx": completions.context_size},
                "modalities": {"vision": False, "audio": False}, "build_info": "duo",
                "duo": {"draft": completions.draft_state, "drafts": completions.drafts()}}

    def _name(self, body: GenerationBody) -> str:
        """The name the answer carries: the one the request gave (any: one model is served), else the model's own."""
        return body.model or self.completions.names[0]

    async def generate(self, body: GenerationBody, to_request: Callable[[], CompletionRequest], request: Request,
                        output: AnswerShape) -> Response:
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




def _piece(text: bytes) -> str | list[int]:
    """A token's text for /tokenize's pieces: the string, or its bytes where they are not whole UTF-8 (as
    llama-server)."""
    try:
        return text.decode()
    except UnicodeDecodeError:
        return list(text)
