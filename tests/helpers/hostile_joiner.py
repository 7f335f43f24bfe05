"""A dishonest draft for the hostile pool soak (tests/e2e/test_hostile_soak_pool.py), run as its own process so that
building and sending its 64 MB Hello holds none of the measuring process's GIL:

    python tests/helpers/hostile_joiner.py TARGET:PORT MODEL.gguf

It joins the pool until its standard input closes, then prints how each Join call ended, as one JSON list."""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import grpc

from duo.net import wire
from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc


class DishonestJoiner:
    """Joins the pool with the right vocabulary, then answers every session it is given with chains that break
    every bound; also tries a 64 MB Hello and a 1 MB model name first."""

    def __init__(self, address: str, vocab: pb.Vocab) -> None:
        self.address, self.vocab = address, vocab
        self.outcomes: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self.outcomes.append(await self._join(pb.Hello(protocol=wire.PROTOCOL, model="m" * (64 << 20),
                                                       vocab=self.vocab), serve=False))
        self.outcomes.append(await self._join(pb.Hello(protocol=wire.PROTOCOL, model="n" * (1 << 20),
                                                       vocab=self.vocab), serve=False))
        while not self.stop.is_set():
            self.outcomes.append(await self._join(pb.Hello(protocol=wire.PROTOCOL, model="dishonest",
                                                           vocab=self.vocab), serve=True))
            await asyncio.sleep(0.2)

    async def _join(self, hello: pb.Hello, *, serve: bool) -> str:
        """One Join call; how it ended ("OK" when it closed without error, "CANCELLED" when told to stop)."""
        sends: asyncio.Queue[pb.JoinUp | None] = asyncio.Queue()
        await sends.put(pb.JoinUp(hello=hello))

        async def up():
            while (message := await sends.get()) is not None:
                yield message

        options = [("grpc.max_send_message_length", 128 << 20), ("grpc.max_receive_message_length", 128 << 20)]
        async with grpc.aio.insecure_channel(self.address, options=options) as channel:
            call = pb_grpc.PoolStub(channel).Join(up())
            watching = asyncio.create_task(self._cancel_when_stopped(call))
            try:
                async for down in call:
                    if not serve:
                        break
                    if down.WhichOneof("message") == "event" and down.event.HasField("open"):
                        for event in self._lies(down.event.open):
                            await sends.put(pb.JoinUp(event=event))
                return "OK"
            except grpc.aio.AioRpcError as error:
                return error.code().name
            except asyncio.CancelledError:  # grpc's way to end the iteration of a call cancelled by _cancel_when_stopped
                return "CANCELLED"
            finally:
                watching.cancel()
                await sends.put(None)
                call.cancel()

    async def _cancel_when_stopped(self, call: grpc.aio.StreamStreamCall) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(0.1)
        call.cancel()

    @staticmethod
    def _lies(opened: pb.OpenSession) -> list[pb.DraftEvent]:
        session, start_at = opened.session_id, len(opened.committed)
        return [pb.DraftEvent(chunk=pb.DraftChunk(session_id=session, epoch=0, start=start_at, tokens=[10 ** 7, -5])),
                pb.DraftEvent(chunk=pb.DraftChunk(session_id=session, epoch=999, start=0, tokens=[1] * 500)),
                pb.DraftEvent(error=pb.SessionError(session_id=session + 1000, message="x" * 10_000))]



def main() -> None:
    from duo.llama.model import Model

    address, model_path = sys.argv[1:3]
    model = Model(model_path, device="cpu", threads=1)
    joiner = DishonestJoiner(address, wire.vocab_to_pb(model.vocab()))
    threading.Thread(target=lambda: (sys.stdin.read(), joiner.stop.set()), daemon=True).start()
    joiner.run()
    print(json.dumps(joiner.outcomes), flush=True)


if __name__ == "__main__":
    main()
