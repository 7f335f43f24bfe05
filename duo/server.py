"""The target's gRPC endpoint for clients: validate a request, stream its completion as it is committed."""

from __future__ import annotations

import codecs
import logging
from typing import AsyncIterator

import grpc

from duo import wire
from duo._proto import duo_pb2 as pb
from duo._proto import duo_pb2_grpc as pb_grpc
from duo.link import incompatible_error
from duo.model import ModelError
from duo.target import GenerationStats, Request, Target

log = logging.getLogger("duo.server")


def stats_to_pb(stats: GenerationStats, draft_connected: bool) -> pb.Stats:
    return pb.Stats(prompt_tokens=stats.prompt_tokens, generated_tokens=stats.generated_tokens,
                    draft_tokens_received=stats.draft_tokens_received,
                    draft_tokens_verified=stats.draft_tokens_verified,
                    draft_tokens_accepted=stats.draft_tokens_accepted, verify_steps=stats.verify_steps,
                    tokens_per_second=stats.tokens_per_second,
                    time_to_first_token_s=stats.time_to_first_token, draft_connected=draft_connected)


class TargetServicer(pb_grpc.TargetServicer):
    """Client calls on duo-target."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def _request(self, message: pb.GenerateRequest) -> Request:
        """Turn a GenerateRequest into a Request, or raise ValueError saying what to fix."""
        params, seed = wire.sampling_from_pb(message.sampling)
        params.validate()
        model = self.target.model
        if message.messages:
            if message.prompt:
                raise ValueError("send either prompt or messages, not both")
            text = model.chat_prompt([{"role": m.role, "content": m.content} for m in message.messages])
        else:
            text = message.prompt
        tokens = model.tokenize(text)
        if not tokens:
            raise ValueError("the prompt is empty")
        return Request(prompt_tokens=tokens, params=params, seed=seed, max_tokens=message.max_tokens)

    async def Generate(self, message: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            request = self._request(message)
        except (ValueError, ModelError) as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        link = self.target.link
        if link is not None and link.state == "incompatible":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, incompatible_error(link))
        # Characters may span tokens: hold back bytes until they complete a character.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            async for step, stats in self.target.generate(request):
                final = step.finish_reason is not None
                text = decoder.decode(self.target.model.detokenize(step.tokens), final=final)
                yield pb.GenerateResponse(text=text, token_ids=step.tokens, finish_reason=step.finish_reason or "",
                                          stats=stats_to_pb(stats, link is not None and link.connected))
        except ModelError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
