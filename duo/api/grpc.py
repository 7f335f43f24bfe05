"""The target's gRPC endpoint for clients: Generate, Tokenize, ModelInfo, health, reflection, and the API key check."""

from __future__ import annotations

import hmac
import logging
from contextlib import aclosing
from typing import Awaitable, Callable, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from duo.net import wire
from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.api.serving.admit import QueueFull
from duo.api.serving.generate import Completions, Piece, failure_message, request_fault
from duo.api.serving.request import BadRequest, ClientError, CompletionRequest, NotReady, ShuttingDown
from duo.constraint import GrammarSpec
from duo.net.options import MAX_CLIENT_RPCS, client_server_options
from duo.net.timeouts import WRITE_TIMEOUT_S, WriteTimeout, write_within

log = logging.getLogger("duo.grpc_api")

TARGET_SERVICE = pb.DESCRIPTOR.services_by_name["Target"].full_name  # "duo.v1.Target"

_STATUS_OF = {BadRequest: grpc.StatusCode.INVALID_ARGUMENT, NotReady: grpc.StatusCode.UNAVAILABLE,
              QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED}


async def abort_for(context: grpc.aio.ServicerContext, error: ClientError | QueueFull) -> NoReturn:
    status = next(code for kind, code in _STATUS_OF.items() if isinstance(error, kind))
    await context.abort(status, str(error))


class TargetServicer(pb_grpc.TargetServicer):
    """Client calls on duo-target."""

    def __init__(self, completions: Completions, write_timeout: float) -> None:
        self.completions = completions
        self.write_timeout = write_timeout

    async def Generate(self, message: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        try:
            params, seed = wire.sampling_from_pb(message.sampling, self.completions.loaded_model())
            request = CompletionRequest(prompt=message.prompt, messages=messages_from_pb(message.messages),
                                        max_tokens=message.max_tokens, params=params, seed=seed,
                                        penalties=wire.penalties_from_pb(message.sampling),
                                        stop=list(message.stop),
                                        cache_prompt=not message.HasField("cache_prompt") or message.cache_prompt,
                                        grammar=GrammarSpec(message.grammar.kind, message.grammar.source, "grammar")
                                        if message.HasField("grammar") else None,
                                        progress=message.return_progress)
            [completion] = await self.completions.start_choices([request])  # Generate has no n: a set of one
        except (ClientError, QueueFull) as error:
            await abort_for(context, error)
        # An error status is sent only once the completion is closed: it waits behind whatever data the
        # client has not read yet, which is forever for a client that stopped reading.
        try:
            async with aclosing(completion):
                async for piece in completion:
                    await write_within(context.write(response_of(piece)), self.write_timeout)
        except ShuttingDown as error:
            await abort_for(context, error)
        except WriteTimeout as error:
            log.warning("dropped client %s: %s", context.peer(), error)
            self.completions.metrics.client_write_timeouts.inc()
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(error))
        except Exception as error:  # this request's own failure: it alone ends
            status = grpc.StatusCode.INVALID_ARGUMENT if request_fault(error) else grpc.StatusCode.INTERNAL
            await context.abort(status, failure_message(error))

    async def Tokenize(self, message: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            tokens = await self.completions.tokenizing(self.completions.tokenize, message.prompt,
                                                           messages_from_pb(message.messages))
        except (ClientError, QueueFull) as error:
            await abort_for(context, error)
        model = self.completions.target.model
        return pb.TokenizeResponse(token_ids=tokens, pieces=[model.token_piece(token, special=True) for token in tokens])

    async def ModelInfo(self, message: pb.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        completions = self.completions
        if completions.target is None:
            await abort_for(context, NotReady("the model is still loading; retry in a moment"))
        target = completions.target
        return pb.ModelInfoResponse(
            name=completions.names[0], aliases=completions.names[1:], description=target.model.description,
            context_size=completions.context_size, n_vocab=target.model.n_vocab,
            draft="" if target.pool is None else target.pool.state,
            draft_address="" if target.pool is None else target.pool.address,
            parallel=completions.admission.parallel, queue_size=completions.admission.queue_size)


def response_of(piece: Piece) -> pb.GenerateResponse:
    response = pb.GenerateResponse(text=piece.text, token_ids=piece.token_ids, finish_reason=piece.finish_reason or "",
                                   stats=pb.Stats(**piece.stats.fields(piece.draft_connected)))
    if piece.progress is not None:
        read = piece.progress
        response.progress.CopyFrom(pb.PromptProgress(total=read.total, cache=read.cache, processed=read.processed,
                                                     seconds=read.seconds))
    return response


def messages_from_pb(messages: list[pb.ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to duo.v1.Target without the metadata `authorization: Bearer <key>` (UNAUTHENTICATED);
    health checks and reflection stay open, so that probes and grpcurl need no key."""

    def __init__(self, api_key: str) -> None:
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{TARGET_SERVICE}/") or self._authorized(details):
            return handler
        make = (grpc.unary_stream_rpc_method_handler if handler.response_streaming
                else grpc.unary_unary_rpc_method_handler)
        return make(_unauthenticated, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        sent = [value for key, value in details.invocation_metadata or () if key == "authorization"]
        given = sent[0].encode() if sent and isinstance(sent[0], str) else b""
        return hmac.compare_digest(given, self._expected)


async def _unauthenticated(request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong API key: send the metadata `authorization: Bearer <key>`")


def client_server(completions: Completions, health_servicer: health.aio.HealthServicer, api_key: str | None, *,
                  write_timeout: float = WRITE_TIMEOUT_S) -> grpc.aio.Server:
    """duo-target's gRPC server for clients: the Target service, health checks and reflection; a client that
    takes no streamed message for `write_timeout` seconds is dropped."""
    interceptors = [ApiKeyInterceptor(api_key)] if api_key else []
    server = grpc.aio.server(options=client_server_options(), interceptors=interceptors,
                             maximum_concurrent_rpcs=MAX_CLIENT_RPCS)
    pb_grpc.add_TargetServicer_to_server(TargetServicer(completions, write_timeout), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [TARGET_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
    return server


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    """Report the whole server and duo.v1.Target as SERVING or NOT_SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", TARGET_SERVICE):
        await health_servicer.set(service, status)
