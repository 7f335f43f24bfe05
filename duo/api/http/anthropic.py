"""POST /v1/messages and /v1/messages/count_tokens on the target's HTTP app: the request read, translated to chat,
and answered (or only tokenized) by duo.api.http.answering."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response

from duo.api.http.answering import Answering
from duo.api.anthropic.answer import MessagesFormat
from duo.api.anthropic.body import CountTokensBody, MessagesBody
from duo.api.anthropic.translate import chat_body
from duo.api.serving.read import document_bodies
from duo.api.serving.request import BadRequest, CompletionRequest
from duo.llama.errors import ModelError

# What the 400 for a system message that the template refuses says: Claude Code drops its beta header and sends the
# message's text in a user message instead where a 400 names this beta and the anthropic-beta header, or says that
# role system is not supported (claude-code 2.1.197, on its fallback "mid-conv-system").
MID_CONVERSATION_BETA = "mid-conversation-system-2026-04-07"
# The code of a prompt that cannot fit the context (duo.api.serving.request.too_long).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class MessagesApi:
    """Anthropic's Messages API over `answering`'s completions."""

    def __init__(self, answering: Answering) -> None:
        self.answering = answering

    async def create(self, request: Request) -> Response:
        completions = self.answering.completions
        with too_long_in_anthropics_words():
            body = await self.answering.read(request, MessagesBody)
            # A loop over the client's messages and tools: off the event loop.
            chat = self.answering.fill_defaults(await asyncio.to_thread(chat_body, body))
            functions = chat.callable_functions()
            call_format = completions.call_format()
            # Any model name is served (Claude Code names Claude's): the answer carries the one asked for.
            output = MessagesFormat(self.answering.model_name(body.model), functions, call_format)
            with system_turns_named(body):
                return await self.answering.answer(chat, chat.to_request, request, output)

    async def count_tokens(self, request: Request) -> dict[str, int]:
        """{"input_tokens": n}: the prompt's tokens as /v1/messages would render them, nothing generated."""
        completions = self.answering.completions
        with too_long_in_anthropics_words():
            body = await self.answering.read(request, CountTokensBody)
            wanted = await asyncio.to_thread(self._checked_request, body)  # loops over the client's blocks and tools
            # The generation's own preparation, so that the count is the prompt's exactly (template, tools, BOS).
            with system_turns_named(body):
                prepared = (await completions.tokenizing(completions.prepare, wanted))[0]
        return {"input_tokens": len(prepared.prompt_tokens)}

    def _checked_request(self, body: CountTokensBody) -> CompletionRequest:
        """The chat request `body` would make, refused where it cannot fit the context (off the event loop)."""
        wanted = chat_body(body).to_request()
        self.answering.completions.check_size(wanted)
        return wanted


@contextmanager
def system_turns_named(body: CountTokensBody) -> Iterator[None]:
    """A chat template's refusal of the messages, where they hold a system message, as a 400 that names the first:
    many templates take a system message only first (Gemma's, Mistral's), and a system message cannot be moved
    elsewhere without changing the prompt, so the client is told to do it, in words Claude Code acts on
    (MID_CONVERSATION_BETA)."""
    try:
        yield
    except BadRequest as error:
        system = next((i for i, message in enumerate(body.messages) if message.role == "system"), None)
        if system is None or not template_refused(error):
            raise
        raise BadRequest(f"messages[{system}]: role 'system' is not supported by this model's chat template after "
                         f"the conversation's start ({error}); send its text in `system` or in a user message, and "
                         f"leave {MID_CONVERSATION_BETA} out of the anthropic-beta header",
                         param=f"messages[{system}].role") from error


@contextmanager
def too_long_in_anthropics_words() -> Iterator[None]:
    """A prompt that cannot fit the context, refused in Anthropic's words too ("prompt is too long: N tokens > M
    maximum"), which Claude Code looks for to tell its user, or to compact the conversation and send it again."""
    try:
        yield
    except BadRequest as error:
        if error.code != CONTEXT_LENGTH_EXCEEDED:
            raise
        sizes = error.details
        raise BadRequest(f"{error} (prompt is too long: {sizes['n_prompt_tokens']} tokens > {sizes['n_ctx']} maximum)",
                         param=error.param, code=error.code, details=sizes) from error


def template_refused(error: BadRequest) -> bool:
    """Whether `error` is the chat template's refusal of the messages (its raise_exception: roles out of order), not
    another fault of the prompt (duo.api.serving.prepare raises the ModelError of duo.llama.model.chat_prompt)."""
    cause = error.__cause__
    return isinstance(cause, ModelError) and cause.__cause__ is not None


def add_messages_routes(app: FastAPI, answering: Answering) -> MessagesApi:
    """Register POST /v1/messages and /v1/messages/count_tokens (behind the gate's key check, which takes
    X-Api-Key as the Anthropic SDK sends it) and their bodies in /openapi.json; their errors, the gate's 401 and 413
    too, are written in Anthropic's shape (duo.api.http.errors chooses it by the path)."""
    messages = MessagesApi(answering)
    app.add_api_route("/v1/messages", messages.create, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"])
    document_bodies(app, {"/v1/messages": MessagesBody, "/v1/messages/count_tokens": CountTokensBody})
    return messages
