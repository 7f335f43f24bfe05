"""POST /v1/responses on the target's HTTP app: the request read, translated to chat, and answered by duo.api.http.answering
(or only counted: llama-server's /v1/responses/input_tokens)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from duo.api.http.answering import Answering
from duo.api.openai.bodies import ChatBody
from duo.api.serving.read import document_bodies
from duo.api.responses.answer import ResponsesFormat
from duo.api.responses.body import ResponsesBody
from duo.api.responses.store import Conversation, ResponseStore, characters
from duo.api.responses.tools import ResponsesTools
from duo.api.responses.translate import chat_body, check_fits, input_messages


class ResponsesApi:
    """The Responses API over `answering`'s completions, with the recent responses it holds for previous_response_id."""

    def __init__(self, answering: Answering, store: ResponseStore | None = None) -> None:
        self.answering = answering
        self.store = store or ResponseStore()

    async def create(self, request: Request) -> Response:
        completions = self.answering.completions
        body = await self.answering.read(request, ResponsesBody)
        body.check_supported()
        history = self.store.conversation(body.previous_response_id) if body.previous_response_id else ()
        # On a worker thread, as the chat endpoint's: a loop over the client's items and tools (and the held ones),
        # and its custom tools' Lark grammars read (tens of ms each).
        tools = await asyncio.to_thread(ResponsesTools, body.tools or [])
        conversation, size, chat = await asyncio.to_thread(self._translated, body, history, tools,
                                                         completions.body_limits().items)
        self.answering.fill_defaults(chat)
        functions = chat.callable_functions()

        def keep(response_id: str, output: list[dict[str, Any]]) -> None:  # the answer's few messages counted here
            self.store.keep(response_id, (*conversation, *output), size + characters(output))

        # The response repeats the settings it ran with: the server's where the body left them out.
        echo = {**body.echo(), "temperature": chat.temperature, "top_p": chat.top_p}
        output = ResponsesFormat(self.answering.model_name(body.model), echo, functions,
                                 completions.call_format(),
                                 keep if body.store is not False else None, tools, body.timings_per_token)
        return await self.answering.answer(chat, chat.to_request, request, output)

    async def input_tokens(self, request: Request) -> dict[str, int]:
        """llama-server's /responses/input_tokens: the prompt's tokens as /responses would read it."""
        completions = self.answering.completions
        body = await self.answering.read(request, ResponsesBody)
        body.check_supported()
        history = self.store.conversation(body.previous_response_id) if body.previous_response_id else ()
        tools = await asyncio.to_thread(ResponsesTools, body.tools or [])
        _, _, chat = await asyncio.to_thread(self._translated, body, history, tools, completions.body_limits().items)
        return await self.answering.input_tokens(chat.to_request)

    def _translated(self, body: ResponsesBody, history: Conversation, tools: ResponsesTools,
                    n_ctx: int) -> tuple[list[dict[str, Any]], int, ChatBody]:
        """The conversation so far (held history and this input, without instructions), its size for the store, and
        its chat request offering `tools`, for a context of `n_ctx` tokens."""
        conversation = [*history, *input_messages(body)]
        check_fits(conversation, n_ctx)
        return conversation, characters(conversation), chat_body(body, conversation, tools)


def add_responses_routes(app: FastAPI, answering: Answering) -> ResponsesApi:
    """Register POST /v1/responses, and /responses as llama-server's OpenAI routes go without /v1 too (both behind
    the gate's key check), and describe their body in /openapi.json."""
    responses = ResponsesApi(answering)
    for path in ("/v1/responses", "/responses"):
        app.add_api_route(path, responses.create, methods=["POST"])
        app.add_api_route(f"{path}/input_tokens", responses.input_tokens, methods=["POST"])
    document_bodies(app, {"/v1/responses": ResponsesBody, "/responses": ResponsesBody})
    return responses
