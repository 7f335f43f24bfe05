"""POST /v1/messages and /v1/messages/count_tokens on the target's HTTP app: the request read, translated to chat,
and answered (or only tokenized) by duo.api.http.answering."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import Response

from duo.api.http.answering import Answering
from duo.api.anthropic.answer import MessagesFormat
from duo.api.anthropic.body import CountTokensBody, MessagesBody
from duo.api.anthropic.translate import chat_body
from duo.api.serving.read import document_bodies
from duo.api.serving.request import CompletionRequest


class MessagesApi:
    """Anthropic's Messages API over `answering`'s completions."""

    def __init__(self, answering: Answering) -> None:
        self.answering = answering

    async def create(self, request: Request) -> Response:
        completions = self.answering.completions
        body = await self.answering.read(request, MessagesBody)
        chat = await asyncio.to_thread(chat_body, body)  # a loop over the client's messages and tools
        functions = chat.callable_functions()
        call_format = completions.call_format()
        # Any model name is served (Claude Code names Claude's): the answer carries the one asked for.
        output = MessagesFormat(self.answering.model_name(body.model), functions, call_format)
        return await self.answering.answer(chat, chat.to_request, request, output)

    async def count_tokens(self, request: Request) -> dict[str, int]:
        """{"input_tokens": n}: the prompt's tokens as /v1/messages would render them, nothing generated."""
        completions = self.answering.completions
        body = await self.answering.read(request, CountTokensBody)
        wanted = await asyncio.to_thread(self._checked_request, body)  # loops over the client's blocks and tools
        # The generation's own preparation, so that the count is the prompt's exactly (template, tools, BOS).
        prepared = (await completions.tokenizing(completions.prepare, wanted))[0]
        return {"input_tokens": len(prepared.prompt_tokens)}


    def _checked_request(self, body: CountTokensBody) -> CompletionRequest:
        """The chat request `body` would make, refused where it cannot fit the context (off the event loop)."""
        wanted = chat_body(body).to_request()
        self.answering.completions.check_size(wanted)
        return wanted


def add_messages_routes(app: FastAPI, answering: Answering) -> MessagesApi:
    """Register POST /v1/messages and /v1/messages/count_tokens (behind the gate's key check, which takes
    X-Api-Key as the Anthropic SDK sends it) and their bodies in /openapi.json; their errors, the gate's 401 and 413
    too, are written in Anthropic's shape (duo.api.http.errors chooses it by the path)."""
    messages = MessagesApi(answering)
    app.add_api_route("/v1/messages", messages.create, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"])
    document_bodies(app, {"/v1/messages": MessagesBody, "/v1/messages/count_tokens": CountTokensBody})
    return messages
