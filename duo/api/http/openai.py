"""OpenAI's routes on the target's HTTP app: /v1/completions, /chat/completions (and llama-server's count of its
prompt, /chat/completions/input_tokens) and the model list (with or without /v1, as llama-server's), the bodies read
and answered by duo.api.http.answering."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from duo.api.http.answering import Answering
from duo.api.openai.answers import ChatFormat, CompletionFormat
from duo.api.openai.bodies import ChatBody, CompletionBody
from duo.api.serving.bodies import GenerationBody
from duo.api.serving.generate import Piece
from duo.api.serving.read import document_bodies
from duo.api.serving.request import CompletionRequest


class OpenAIApi:
    """OpenAI's completions, chat and models over `answering`'s completions."""

    def __init__(self, answering: Answering, aliases: Sequence[str] = (), tags: Sequence[str] = ()) -> None:
        self.answering = answering
        self.completions = answering.completions
        self.aliases, self.tags = list(aliases), list(tags)

    def models(self) -> dict[str, Any]:
        """One model, as llama-server lists it: its name (the first alias, else the file's), its aliases and tags."""
        card = self._model_card(self.completions.names[0])
        return {"object": "list", "data": [card | {"aliases": self.aliases, "tags": self.tags}]}

    def model(self, model_id: str) -> dict[str, Any]:
        """Any name is this server's one model (as llama-server serves whatever `model` a request names)."""
        return self._model_card(model_id)

    def _model_card(self, name: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "duo"}
        if self.completions.target is not None:  # llama-server's meta: clients size their prompts by n_ctx_train
            card["meta"] = self.completions.target.model.meta()
        return card

    async def completion(self, request: Request) -> Response:
        body = await self.answering.read(request, CompletionBody)
        to_request, verbose = self._verbose(body)
        return await self.answering.answer(body, to_request, request,
                                           CompletionFormat(self.answering.model_name(body.model),
                                                            sources=body.duo_sources,
                                                            timings_per_token=body.timings_per_token,
                                                            verbose=verbose))

    async def chat(self, request: Request) -> Response:
        body = await self.answering.read(request, ChatBody)
        functions = body.callable_functions()
        to_request, verbose = self._verbose(body)
        # The template's format even without functions: it says how the model marks its reasoning.
        return await self.answering.answer(body, to_request, request,
                                           ChatFormat(self.answering.model_name(body.model), functions,
                                                      self.completions.call_format(), sources=body.duo_sources,
                                                      timings_per_token=body.timings_per_token, verbose=verbose,
                                                      post_sampling=body.post_sampling_probs))

    def _verbose(self, body: GenerationBody) -> tuple[Callable[[], CompletionRequest],
                                                     Callable[[list[Piece]], dict[str, Any]] | None]:
        """`body`'s translation and, where it asks llama-server's `verbose`, the native answer that goes with it
        (its generation_settings read from the translated request)."""
        if not body.verbose:
            return body.to_request, None
        native = self.answering.native_format(body)

        def translated() -> CompletionRequest:
            native.request = body.to_request()
            return native.request

        return translated, native.whole

    async def chat_input_tokens(self, request: Request) -> dict[str, int]:
        body = await self.answering.read(request, ChatBody)
        return await self.answering.input_tokens(body.to_request)


def add_openai_routes(app: FastAPI, answering: Answering, *, aliases: Sequence[str] = (),
                      tags: Sequence[str] = ()) -> OpenAIApi:
    """Register OpenAI's routes, with or without /v1 as llama-server's (but /completions: llama-server's native
    completion there, duo.api.http.llama_server), and describe their bodies in /openapi.json. The model list
    carries `aliases` and `tags` (llama-server's -a and --tags)."""
    api = OpenAIApi(answering, aliases, tags)
    for prefix in ("", "/v1"):
        app.add_api_route(f"{prefix}/models", api.models, methods=["GET"])
        app.add_api_route(f"{prefix}/chat/completions", api.chat, methods=["POST"])
        app.add_api_route(f"{prefix}/chat/completions/input_tokens", api.chat_input_tokens, methods=["POST"])
    app.add_api_route("/v1/models/{model_id}", api.model, methods=["GET"])
    app.add_api_route("/v1/completions", api.completion, methods=["POST"])
    document_bodies(app, {"/v1/completions": CompletionBody, "/v1/chat/completions": ChatBody,
                          "/chat/completions": ChatBody})
    return api
