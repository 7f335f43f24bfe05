"""The shape of the code base: modules import each other without a circle, and each stays readable."""

from __future__ import annotations

import ast
from pathlib import Path

DUO = Path(__file__).resolve().parent.parent / "duo"
MAX_LINES = 450
# The generation loops of both processes: they must not reach up to the endpoints and command lines.
LOOP_MODULES = {"duo.target", "duo.draft", "duo.chain", "duo.policy", "duo.sampling", "duo.model", "duo.link"}
PROCESS_MODULES = {"duo.target_process", "duo.draft_process", "duo.cli", "duo.grpc_api", "duo.openai_api",
                   "duo.completion", "duo.demo", "duo.grpc_client"}


def duo_modules() -> dict[str, Path]:
    return {"duo." + path.stem if path.stem != "__init__" else "duo": path
            for path in DUO.glob("*.py")}


def imported_duo_modules(path: Path, known: set[str]) -> set[str]:
    """Every duo module `path` imports, at the top or inside a function, as `import` or `from ... import`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from duo import wire` imports the module duo.wire; `from duo.x import y` imports duo.x.
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = duo_modules()
    known = set(modules)
    return {name: imported_duo_modules(path, known) - {"duo", name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list of modules that import each other in a circle, or None (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for neighbour in sorted(graph.get(node, ())):
            if state.get(neighbour) == "open":
                return stack[stack.index(neighbour):] + [neighbour]
            if neighbour not in state and (cycle := visit(neighbour)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for neighbour in graph.get(todo.pop(), ()):
            if neighbour not in seen:
                seen.add(neighbour)
                todo.append(neighbour)
    return seen


def test_the_cycle_finder_finds_a_circle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_duo_modules_import_each_other_without_a_circle():
    assert find_cycle(import_graph()) is None


def test_the_generation_loops_import_no_endpoint_or_command_line():
    graph = import_graph()
    for module in LOOP_MODULES:
        assert not reachable(graph, module) & PROCESS_MODULES, module


def test_every_module_stays_short_enough_to_read():
    long = {path.name: n for path in DUO.glob("*.py") if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"
