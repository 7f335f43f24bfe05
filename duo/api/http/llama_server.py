"""llama-server's native routes on the target's HTTP app, as scripts written for llama.cpp call them: /completion,
/infill, /tokenize, /detokenize, /apply-template, /props, /slots, /health and /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from duo.api.http.answering import Answering
from duo.api.llama_server.settings import generation_settings
from duo.api.llama_server.bodies import ApplyTemplateBody, DetokenizeBody, InfillBody, NativeCompletionBody, TokenizeBody
from duo.api.openai.errors import ApiError
from duo.api.serving.metrics import CONTENT_TYPE
from duo.api.serving.read import document_bodies
from duo.api.serving.request import CompletionRequest


class LlamaServerApi:
    """llama-server's native endpoints over `answering`'s completions."""

    def __init__(self, answering: Answering, *, slots: bool = True, metrics: bool = False) -> None:
        self.answering = answering
        self.slots_shown = slots  # llama-server's --no-slots turns GET /slots off
        self.metrics_shown = metrics  # and its --metrics GET /metrics on
        self.completions = answering.completions
        self.metrics = answering.metrics

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
        """Prometheus text (duo's metrics and llama-server's) with llama-server's Process-Start-Time-Unix header,
        named as it writes it (Starlette would lower its case); 501 without --metrics, in llama-server's words."""
        if not self.metrics_shown:
            raise ApiError(501, "This server does not support metrics endpoint. Start it with `--metrics`",
                           type="not_supported_error")
        response = Response(self.metrics.render(), media_type=CONTENT_TYPE)
        response.raw_headers.append((b"Process-Start-Time-Unix", str(self.metrics.started).encode()))
        return response

    def slots(self) -> list[dict[str, Any]]:
        """llama-server's /slots, read-only: duo's running places (--parallel), those at work first; 501 after
        --no-slots, in llama-server's words."""
        if not self.slots_shown:
            raise ApiError(501, "This server does not support slots endpoint. Start it with `--slots`",
                           type="not_supported_error")
        completions = self.completions
        admission = completions.admission
        return [{"id": slot, "n_ctx": completions.context_size, "is_processing": slot < admission.running,
                 "speculative": completions.draft_connected} for slot in range(admission.parallel)]

    async def native_completion(self, request: Request) -> Response:
        return await self._native(request, NativeCompletionBody)

    async def infill(self, request: Request) -> Response:
        return await self._native(request, InfillBody)

    async def _native(self, request: Request, kind: type[NativeCompletionBody]) -> Response:
        body = await self.answering.read(request, kind)
        output = self.answering.native_format(body, body.response_fields)

        def translated() -> list[CompletionRequest]:  # the first kept by the answer, for its generation_settings
            batch = body.to_requests()
            output.request = batch[0]
            return batch

        return await self.answering.answer_batch(body, translated, request, output)

    async def tokenize(self, request: Request) -> dict[str, Any]:
        body = await self.answering.read(request, TokenizeBody)
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
        body = await self.answering.read(request, DetokenizeBody)
        body.check_fields()
        model = self.completions.loaded_model()

        def text() -> str:  # on a worker thread, the range check too: a context's worth of ids (of any size)
            if body.tokens and not (min(body.tokens) >= 0 and max(body.tokens) < model.n_vocab):
                raise ApiError(400, f"token ids must be between 0 and {model.n_vocab - 1}", param="tokens")
            return model.detokenize(body.tokens).decode(errors="replace")

        return {"content": await self.completions.tokenizing(text)}

    async def apply_template(self, request: Request) -> dict[str, Any]:
        body = await self.answering.read(request, ApplyTemplateBody)
        body.check_fields()
        model = self.completions.loaded_model()

        def prompt() -> str:  # on a worker thread: a loop over the client's messages and tools
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
            messages, turn = body.turn()
            return model.chat_prompt(messages, tools, generation_prompt=turn.generation_prompt) + (turn.prefill or "")

        return {"prompt": await self.completions.tokenizing(prompt)}

    def _default_settings(self) -> dict[str, Any]:
        """What a /completion body that sets nothing runs with: the launch line's defaults (--temp, --seed, -n)."""
        body = NativeCompletionBody(prompt="")
        self.answering.defaults.fill(body)
        return generation_settings(body.native_request(prompt=""))

    def props(self) -> dict[str, Any]:
        completions = self.completions
        model = completions.loaded_model()
        return {"model_alias": completions.names[0], "model_path": str(model.path),
                "total_slots": completions.admission.parallel, "chat_template": model.chat_template(),
                "default_generation_settings": {"n_ctx": completions.context_size, "params": self._default_settings()},
                "modalities": {"vision": False, "audio": False}, "build_info": "duo",
                "duo": {"draft": completions.draft_state, "drafts": completions.drafts()}}


def _piece(text: bytes) -> str | list[int]:
    """A token's text for /tokenize's pieces: the string, or its bytes where they are not whole UTF-8 (as
    llama-server)."""
    try:
        return text.decode()
    except UnicodeDecodeError:
        return list(text)


def add_llama_server_routes(app: FastAPI, answering: Answering, *, slots: bool = True,
                            metrics: bool = False) -> LlamaServerApi:
    """Register llama-server's native routes (/completions without /v1 is its native /completion, as there; /health
    with or without /v1) and describe their bodies in /openapi.json."""
    api = LlamaServerApi(answering, slots=slots, metrics=metrics)
    for prefix in ("", "/v1"):
        app.add_api_route(f"{prefix}/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics_text, methods=["GET"])
    for path in ("/completion", "/completions"):
        app.add_api_route(path, api.native_completion, methods=["POST"])
    app.add_api_route("/infill", api.infill, methods=["POST"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/apply-template", api.apply_template, methods=["POST"])
    app.add_api_route("/props", api.props, methods=["GET"])
    app.add_api_route("/slots", api.slots, methods=["GET"])
    document_bodies(app, {"/completion": NativeCompletionBody, "/completions": NativeCompletionBody,
                          "/infill": InfillBody, "/tokenize": TokenizeBody, "/detokenize": DetokenizeBody,
                          "/apply-template": ApplyTemplateBody})
    return api
