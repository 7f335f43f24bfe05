"""duo-draft: a gRPC server that keeps drafting chains ahead of each session's committed tokens."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import sys
from dataclasses import dataclass, field, replace
from typing import AsyncIterable, AsyncIterator, Sequence

import grpc
import numpy as np

from duo import wire
from duo._proto import duo_pb2 as pb
from duo._proto import duo_pb2_grpc as pb_grpc
from duo.model import Context, IncompatibleVocab, Model, ModelError, check_compatible
from duo.runtime import ModelWorker, grpc_server_options, run_server
from duo.sampling import SamplingParams, SparseDist, distribution, sample

log = logging.getLogger("duo.draft")


@dataclass
class DraftSession:
    """One target session as the draft sees it: the committed tokens followed by its own chain."""

    session_id: int
    chain: list[int]  # committed tokens, then drafted ones
    committed: int
    params: SamplingParams
    rng: np.random.Generator
    max_ahead: int
    p_min: float
    context: Context
    epoch: int = 0
    paused: bool = False  # after a low-confidence or end-of-generation token, until the next commit
    closed: bool = False
    kv_tokens: list[int] = field(default_factory=list)  # what the KV cache holds; model thread only

    def wants_to_draft(self) -> bool:
        return (not self.paused and not self.closed and len(self.chain) - self.committed < self.max_ahead
                and len(self.chain) < self.context.n_ctx)

    def apply_commit(self, start: int, tokens: Sequence[int]) -> None:
        """Keep the chain where the target agreed with it, else restart it (a new epoch) from the commit."""
        end = start + len(tokens)
        if self.chain[start:end] != list(tokens):
            # The commit contradicted the chain or ran past it: restart from the committed sequence.
            # Its KV entries stay where they match; the next step rolls the cache back to the fork.
            self.chain = self.chain[:start] + list(tokens)
            self.epoch += 1
        self.committed = end
        self.paused = False


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def draft_one(session: DraftSession, chain: list[int], model: Model) -> tuple[int, SparseDist, float]:
    """Decode what the KV cache lacks of `chain` and draw the next token (runs on the model thread).

    Returns the token, the distribution it was drawn from, and the draft's confidence in it: its
    probability at temperature 1, which is what --draft-p-min is compared with (1.0 without a
    p_min: a softmax over the vocabulary is worth skipping on every drafted token).
    """
    keep = common_prefix_length(session.kv_tokens, chain)
    keep = min(keep, len(chain) - 1)  # at least one token must be decoded to get fresh logits
    session.context.rollback(keep)
    del session.kv_tokens[keep:]
    logits = session.context.decode(chain[keep:], keep)[-1]
    session.kv_tokens.extend(chain[keep:])
    dist = distribution(logits, session.params)
    token = sample(dist, session.rng)
    if session.p_min <= 0:
        return token, dist, 1.0
    shifted = logits.astype(np.float64) - logits.max()
    return token, dist, float(np.exp(shifted[token]) / np.exp(shifted).sum())


class Drafter:
    """Drafts for every session of every connected target on one model, one token per step, in turns."""

    def __init__(self, model: Model, worker: ModelWorker, n_ctx: int, top_k_cap: int) -> None:
        self.model = model
        self.worker = worker
        self.n_ctx = n_ctx
        self.top_k_cap = top_k_cap

    def draft_params(self, params: SamplingParams) -> SamplingParams:
        """The session's sampling, further truncated to the draft's top-k cap.

        Any q is lossless as long as the target is told the q a token was really drawn from, and a
        narrow q keeps each message small (a full-vocabulary q is 1 MB per token). llama.cpp's
        speculative example drafts from the top 10 for the same reason.
        """
        if params.greedy:
            return params
        return replace(params, top_k=min(params.top_k or self.top_k_cap, self.top_k_cap))

    async def open(self, message: pb.OpenSession) -> DraftSession:
        params, seed = wire.sampling_from_pb(message.sampling)
        committed = list(message.committed)
        if not committed:
            raise ModelError("a session needs at least one committed token (the prompt)")
        context = await self.worker.run(self.model.new_context, self.n_ctx)
        if len(committed) >= context.n_ctx:
            await self.worker.run(context.close)
            raise ModelError(f"the prompt ({len(committed)} tokens) does not fit the draft's context "
                             f"of {context.n_ctx}; start duo-draft with a larger --ctx-size")
        return DraftSession(
            session_id=message.session_id, chain=committed, committed=len(committed), params=self.draft_params(params),
            rng=np.random.default_rng(None if seed is None else [seed, 1]),  # independent of the target's
            max_ahead=message.max_ahead, p_min=message.p_min, context=context)

    async def close(self, session: DraftSession) -> None:
        session.closed = True
        await self.worker.run(session.context.close)

    async def step(self, session: DraftSession) -> pb.DraftChunk | None:
        """Draft one token; None when a commit changed the chain meanwhile or the draft lost confidence."""
        chain, epoch = list(session.chain), session.epoch
        token, dist, confidence = await self.worker.run(draft_one, session, chain, self.model)
        if session.closed or session.epoch != epoch or len(session.chain) != len(chain):
            return None  # drafted on a chain that a commit has just replaced
        if confidence < session.p_min:
            session.paused = True
            return None
        session.chain.append(token)
        if self.model.is_end_of_generation(token):
            session.paused = True  # nothing follows an end of generation
        dists = [] if session.params.greedy else [wire.dist_to_pb(dist)]
        return pb.DraftChunk(session_id=session.session_id, epoch=epoch, start=len(chain), tokens=[token],
                             dists=dists)


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
    parser.add_argument("--model", required=True, help="GGUF path or a name from `duo models list`")
    parser.add_argument("--device", default="auto", choices=["cpu", "cuda", "metal", "vulkan", "auto"],
                        help="where to run the model (a GPU this build cannot use is an error)")
    parser.add_argument("--gpu-layers", type=int, default=None, help="layers to offload (default: all)")
    parser.add_argument("--listen", default="127.0.0.1:7070", help="HOST:PORT to serve targets on")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--ctx-size", type=int, default=4096, help="context size per session")
    parser.add_argument("--top-k-cap", type=int, default=10,
                        help="when sampling, draft among at most this many tokens (output stays exact)")
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help="serve targets over TLS with this PEM certificate (chain)")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="the PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="mutual TLS: accept only targets presenting a certificate signed by this PEM CA")
    parser.add_argument("--log-level", default="INFO")
    return parser


def check_tls_flags(args: argparse.Namespace) -> None:
    from duo.tls import check_pair

    if not check_pair(args.tls_cert, args.tls_key, "--tls-cert/--tls-key") and args.tls_ca:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")


async def serve(args: argparse.Namespace, model: Model) -> None:
    from duo.tls import server_credentials

    worker = ModelWorker()
    server = grpc.aio.server(options=grpc_server_options())
    pb_grpc.add_DraftServicer_to_server(DraftServicer(Drafter(model, worker, args.ctx_size, max(1, args.top_k_cap))), server)
    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
    security = " over mutual TLS" if args.tls_ca else " over TLS" if args.tls_cert else ""
    await run_server(server, args.listen, f"duo-draft serving {describe(model)} on {args.listen}{security}",
                     credentials=credentials)


def main(argv: list[str] | None = None) -> int:
    from duo.hub import HubError, resolve_model
    from duo.runtime import run_async, setup_logging

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
