"""A request answered over HTTP whatever its protocol: its body read; the translated request's choices started, then
streamed or collected and rendered in the protocol's shape (AnswerShape); several choices merged into one answer."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from duo.api.http.streams import CLIENT_CLOSED, ClientGone, EventStream, unless_disconnected
from duo.api.llama_server.answer import NativeFormat
from duo.api.openai.answers import OpenAIFormat, sse
from duo.api.openai.errors import generation_error
from duo.api.serving.bodies import GenerationBody
from duo.api.serving.choices import Choice, Choices, choice_requests, merge
from duo.api.serving.defaults import ServerDefaults
from duo.api.serving.generate import Completions, Piece
from duo.api.serving.metrics import Metrics
from duo.api.serving.read import Body, parse_body
from duo.api.serving.request import BadRequest, CompletionRequest, ShuttingDown

DONE = "data: [DONE]\n\n"


class AnswerShape(Protocol):
    """How a protocol shapes one answer: whole (a JSON object) or as server-sent events."""

    def whole(self, pieces: list[Piece]) -> dict[str, Any]: ...

    def events(self, choice: Choice, include_usage: bool) -> AsyncIterator[str]: ...


class Answering:
    """Answers a body translated to duo's request, in its protocol's `AnswerShape`, from the target's Completions;
    every protocol's route reads its body here and hands its generations here."""

    def __init__(self, completions: Completions, metrics: Metrics, write_timeout: float,
                 defaults: ServerDefaults = ServerDefaults()) -> None:
        self.completions = completions
        self.metrics = metrics
        self.write_timeout = write_timeout
        self.defaults = defaults  # the launch line's sampling defaults, for the fields a body leaves out

    async def read(self, request: Request, kind: type[Body]) -> Body:
        """`request`'s body read as `kind`, its lists bounded by what the model can use (duo.api.serving.read), with
        the launch line's defaults for the fields it leaves out: what the route reads of it first (verbose) is the
        server's where the body is silent."""
        body = await parse_body(await request.body(), kind, self.completions.body_limits())
        if isinstance(body, GenerationBody):
            self.defaults.fill(body)
        return body

    def fill_defaults(self, body: GenerationBody) -> GenerationBody:
        """`body`, one a route made from another protocol's (Anthropic's, Responses'), with the launch line's defaults
        for the fields it leaves out, as `read` gives a body it reads."""
        self.defaults.fill(body)
        return body

    def native_format(self, body: GenerationBody, response_fields: list[str] | None = None) -> NativeFormat:
        """llama-server's native answer for `body` (its /completion, and the __verbose of a verbose OpenAI answer):
        the prompt shown with its special tokens, an answer that filled the context `truncated`."""
        completions = self.completions
        return NativeFormat(self.model_name(body.model), response_fields, context_size=completions.context_size,
                            detokenize=lambda ids: completions.loaded_model().detokenize(ids, special=True).decode(
                                errors="replace"), timings_per_token=body.timings_per_token)

    def model_name(self, asked: str | None) -> str:
        """The name an answer carries: the one the request gave (any: one model is served), else the model's own."""
        return asked or self.completions.names[0]

    async def input_tokens(self, to_request: Callable[[], CompletionRequest]) -> dict[str, int]:
        """{"input_tokens": n}: the prompt's tokens as the generation would read them (llama-server's
        /chat/completions/input_tokens and /responses/input_tokens), nothing generated."""
        completions = self.completions

        def checked() -> CompletionRequest:  # a loop over the client's messages and tools, off the event loop
            wanted = to_request()
            completions.check_size(wanted)
            return wanted

        wanted = await asyncio.to_thread(checked)
        # The generation's own preparation, so that the count is the prompt's exactly (template, tools, BOS).
        prepared = (await completions.tokenizing(completions.prepare, wanted))[0]
        return {"input_tokens": len(prepared.prompt_tokens)}

    async def answer(self, body: GenerationBody, to_request: Callable[[], CompletionRequest], request: Request,
                     output: AnswerShape) -> Response:
        """The answer of `body`'s n choices (one, most often): a stream of events, or one JSON answer."""
        return await self.answer_batch(body, lambda: [to_request()], request, output)

    async def answer_batch(self, body: GenerationBody, to_requests: Callable[[], list[CompletionRequest]],
                           request: Request, output: AnswerShape) -> Response:
        """The answer of `body`'s n choices of each of its prompts (llama-server's batch; one prompt, most often).
        `body` has the launch line's defaults: `read` gave them, or the route that translated it (fill_defaults)."""
        parallel = self.completions.admission.parallel
        n = body.choice_count(parallel)
        batch = await asyncio.to_thread(to_requests)  # a loop over the client's biases, tools and messages
        wanted = [choice for prompt in batch for choice in choice_requests(prompt, n)]
        if len(wanted) > parallel:  # the places are taken together: no more than there are
            raise BadRequest(f"{len(batch)} prompts of {n} choices each are {len(wanted)} generations; at most "
                             f"{parallel} (duo-target's --parallel) run as one request", param="prompt")
        formats = [output] + [copy.deepcopy(output) for _ in range(len(wanted) - 1)]  # each its own, one answer's id
        try:
            choices = await unless_disconnected(request, Choices.start(self.completions, wanted))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        if body.stream:
            return EventStream(events(formats, choices, body.include_usage), choices, write_timeout=self.write_timeout,
                               on_timeout=self.metrics.client_write_timeouts.inc)
        async with aclosing(choices):
            try:
                pieces = await unless_disconnected(request, choices.collect())
            except ClientGone:
                return Response(status_code=CLIENT_CLOSED)
            except ShuttingDown:
                raise  # a 503 like any ClientError, from the app's handlers
            except Exception as error:  # this request's own failure: it alone ends, in its protocol's error shape
                raise generation_error(error) from error
        return JSONResponse(whole(formats, pieces))


def events(formats: Sequence[AnswerShape], choices: Choices, include_usage: bool) -> AsyncIterator[str]:
    """The answer's events: one choice's as its protocol streams them, several merged (merged_events)."""
    if len(choices.choices) == 1:
        return formats[0].events(choices.choices[0], include_usage)
    return merged_events(formats, choices, include_usage)


def whole(formats: Sequence[AnswerShape], pieces: Sequence[list[Piece]]) -> Any:
    """The whole answer: one choice's as its protocol answers it, several as one (whole_answer)."""
    if len(pieces) == 1:
        return formats[0].whole(pieces[0])
    return whole_answer(formats, pieces)


def whole_answer(formats: Sequence[OpenAIFormat | NativeFormat], pieces: Sequence[list[Piece]]) -> Any:
    """The answers of all choices as one: OpenAI's choices (index i), usage summed, duo_stats a list (one per
    choice); llama-server's native answer is an array of its answers, each with its index."""
    answers = [output.whole(choice) for output, choice in zip(formats, pieces)]
    if isinstance(formats[0], NativeFormat):
        return [{**answer, "index": i} for i, answer in enumerate(answers)]
    return {**answers[0], "choices": [{**answer["choices"][0], "index": i} for i, answer in enumerate(answers)],
            "usage": summed_usage([answer["usage"] for answer in answers]),
            "duo_stats": [answer["duo_stats"] for answer in answers]}


def summed_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One prompt, read once, and every choice's tokens."""
    completion = sum(usage["completion_tokens"] for usage in usages)
    first = usages[0]
    return {**first, "completion_tokens": completion, "total_tokens": first["prompt_tokens"] + completion}


async def merged_events(formats: Sequence[OpenAIFormat | NativeFormat], choices: Choices,
                        include_usage: bool) -> AsyncIterator[str]:
    """Every choice's events as they come, each marked with its choice's index; OpenAI's stream then ends with one
    usage chunk (where asked) and one [DONE]."""
    native = isinstance(formats[0], NativeFormat)
    usages = []
    streams = [output.events(choice, include_usage) for output, choice in zip(formats, choices.choices)]
    async for i, event in merge(streams):
        if event == DONE:
            continue
        data = json.loads(event.removeprefix("data: "))
        if native and "error" not in data:
            data["index"] = i
        elif data.get("choices") == [] and "usage" in data:
            usages.append(data["usage"])
            continue
        for choice in data.get("choices", []):
            choice["index"] = i
        yield sse(data)
    if usages:
        yield sse({**formats[0].envelope(formats[0].chunk_object_name), "choices": [], "usage": summed_usage(usages)})
    if not native:
        yield DONE
