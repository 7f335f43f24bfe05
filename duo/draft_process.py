"""duo-draft: its command line, and the gRPC server that streams each target session's chain (proto/duo.proto)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import sys
from typing import AsyncIterable, AsyncIterator

import grpc

from duo import wire
from duo._proto import duo_pb2 as pb
from duo._proto import duo_pb2_grpc as pb_grpc
from duo.draft import Drafter, DraftSession
from duo.hub import HubError, resolve_model
from duo.model import IncompatibleVocab, Model, ModelError, check_compatible
from duo.runtime import ModelWorker, add_process_arguments, grpc_server_options, run_async, run_server, setup_logging
from duo.tls import check_pair, server_credentials

log = logging.getLogger("duo.draft")


class DraftServicer(pb_grpc.DraftServicer):
    """The draft side of proto/duo.proto."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.vocab = drafter.model.vocab()

    async def Handshake(self, request: pb.Hello, context: grpc.aio.ServicerContext) -> pb.Hello:
        peer = context.peer()
        if request.protocol != wire.PROTOCOL:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"protocol {request.protocol!r} is not {wire.PROTOCOL!r}: run the same duo version on both sides")
        try:
            check_compatible(wire.vocab_from_pb(request.vocab), self.vocab)
        except IncompatibleVocab as error:
            message = f"draft {self.drafter.model.path.name} cannot draft for target {request.model}: {error}"
            log.error("refused target %s: %s", peer, message)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
        log.info("target %s connected (%s)", peer, request.model)
        return pb.Hello(protocol=wire.PROTOCOL, model=describe(self.drafter.model), vocab=wire.vocab_to_pb(self.vocab))

    async def Speculate(self, request_iterator: AsyncIterable[pb.TargetEvent],
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DraftEvent]:
        sessions: dict[int, DraftSession] = {}
        outbox: asyncio.Queue[pb.DraftEvent | None] = asyncio.Queue()
        wake = asyncio.Event()
        reader = asyncio.create_task(self._read(request_iterator, sessions, outbox, wake))
        drafting = asyncio.create_task(self._draft(sessions, outbox, wake))
        for task in (reader, drafting):
            task.add_done_callback(lambda done: outbox.put_nowait(None))  # ends the stream
        try:
            while (event := await outbox.get()) is not None:
                yield event
        finally:
            reader.cancel()
            drafting.cancel()
            await asyncio.gather(reader, drafting, return_exceptions=True)
            for session in sessions.values():
                await self.drafter.close(session)
            log.info("target %s left; closed %d session(s)", context.peer(), len(sessions))

    async def _read(self, request_iterator: AsyncIterable[pb.TargetEvent], sessions: dict[int, DraftSession],
                    outbox: asyncio.Queue[pb.DraftEvent | None], wake: asyncio.Event) -> None:
        async for event in request_iterator:
            kind = event.WhichOneof("event")
            if kind == "open":
                await self._open(event.open, sessions, outbox)
            elif kind == "commit" and event.commit.session_id in sessions:
                sessions[event.commit.session_id].apply_commit(event.commit.start, event.commit.tokens)
            elif kind == "steer" and event.steer.session_id in sessions:
                sessions[event.steer.session_id].max_ahead = event.steer.max_ahead
            elif kind == "close" and event.close.session_id in sessions:
                await self.drafter.close(sessions.pop(event.close.session_id))
            wake.set()

    async def _open(self, message: pb.OpenSession, sessions: dict[int, DraftSession],
                    outbox: asyncio.Queue[pb.DraftEvent | None]) -> None:
        if message.session_id in sessions:
            await self.drafter.close(sessions.pop(message.session_id))
        try:
            sessions[message.session_id] = await self.drafter.open(message)
        except (ModelError, ValueError) as error:
            log.warning("session %d not drafted: %s", message.session_id, error)
            outbox.put_nowait(pb.DraftEvent(error=pb.SessionError(session_id=message.session_id, message=str(error))))

    async def _draft(self, sessions: dict[int, DraftSession], outbox: asyncio.Queue[pb.DraftEvent | None],
                     wake: asyncio.Event) -> None:
        """Round-robin over sessions that want tokens; sleep until an event when none does."""
        for turn in itertools.count():
            ready = [s for s in sessions.values() if s.wants_to_draft()]
            if not ready:
                wake.clear()
                await wake.wait()
                continue
            session = ready[turn % len(ready)]
            try:
                chunk = await self.drafter.step(session)
            except ModelError as error:
                log.warning("session %d: drafting stopped: %s", session.session_id, error)
                session.paused = True
                continue
            if chunk is not None:
                outbox.put_nowait(pb.DraftEvent(chunk=chunk))


def describe(model: Model) -> str:
    return f"{model.path.name} ({model.description})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duo-draft", description=__doc__)
    add_process_arguments(parser, listen="127.0.0.1:7070", serves="targets", per="session")
    parser.add_argument("--top-k-cap", type=int, default=10,
                        help="when sampling, draft among at most this many tokens (output stays exact)")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="mutual TLS: accept only targets presenting a certificate signed by this PEM CA")
    return parser


def check_tls_flags(args: argparse.Namespace) -> None:
    if not check_pair(args.tls_cert, args.tls_key, "--tls-cert/--tls-key") and args.tls_ca:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")


async def serve(args: argparse.Namespace, model: Model) -> None:
    worker = ModelWorker()
    server = grpc.aio.server(options=grpc_server_options())
    pb_grpc.add_DraftServicer_to_server(DraftServicer(Drafter(model, worker, args.ctx_size, max(1, args.top_k_cap))), server)
    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
    security = " over mutual TLS" if args.tls_ca else " over TLS" if args.tls_cert else ""
    await run_server(server, args.listen, f"duo-draft serving {describe(model)} on {args.listen}{security}",
                     credentials=credentials)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        check_tls_flags(args)
        model = Model(resolve_model(args.model), device=args.device, n_gpu_layers=args.gpu_layers,
                      threads=args.threads)
    except (HubError, ModelError, ValueError) as error:
        print(f"duo-draft: {error}", file=sys.stderr)
        return 1
    if not model.can_rollback:
        print(f"duo-draft: {args.model} is a recurrent/hybrid model; drafting needs rollback", file=sys.stderr)
        return 1
    model.warm_up()
    return run_async(serve(args, model))


if __name__ == "__main__":
    sys.exit(main())
