"""duo-target and duo-draft freeze what starting built: a body parsed later (many small containers) sets off full
collections that walk only what came after, not the process's start-up heap again, under the GIL."""

from __future__ import annotations

import gc
import weakref

from duo.cli.process import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_the_heap_alive_at_the_start_is_out_of_full_collections_and_its_garbage_is_collected_first():
    tables = [[index, f"token {index}"] for index in range(2000)]  # as a model's tables: many tracked containers
    cycle = Node()
    cycle.other = Node()
    cycle.other.other = cycle  # garbage of starting, reachable only from itself
    gone = weakref.ref(cycle)
    del cycle
    gc.unfreeze()
    try:
        freeze_startup_heap()
        assert gone() is None, "start-up garbage in a cycle would be kept for good by the freeze"
        walked = {id(thing) for thing in gc.get_objects()}
        assert not any(id(row) in walked for row in tables), "a full collection would walk the start-up heap again"
        body = [[index, False] for index in range(2000)]  # a body parsed while serving: still collected as usual
        assert id(body[0]) in {id(thing) for thing in gc.get_objects()}
    finally:
        gc.unfreeze()
