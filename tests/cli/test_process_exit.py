"""duo-target and duo-draft end quickly once stopped: the interpreter's exit does not walk the objects left alive."""

from __future__ import annotations

import gc

from duo.cli.process import run_async


def test_the_objects_alive_when_the_servers_stop_are_left_out_of_the_exits_garbage_collection():
    vocabulary = [(index, f"token {index}".encode()) for index in range(1000)]  # as a model's vocabulary, many objects

    async def serve_then_stop() -> None:
        vocabulary.append((len(vocabulary), b"served"))

    gc.unfreeze()
    try:
        assert run_async(serve_then_stop()) == 0
        assert gc.get_freeze_count() >= len(vocabulary), "the interpreter's exit would walk them all again"
    finally:
        gc.unfreeze()
