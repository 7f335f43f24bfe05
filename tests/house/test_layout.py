"""The shape of the code base: packages by owner on floors that import only downwards, no circle, short modules."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DUO = ROOT / "duo"
MAX_LINES = 450
GENERATED = "duo.net._proto"  # protoc's stubs (scripts/gen_proto.py): shared, but not held to MAX_LINES
# The floors of the house, top first. A module imports its own package and the floors below its own,
# never a floor above, nor another package on its own floor (the two loops share the wire, not code).
FLOORS: list[set[str]] = [
    {"duo.cli"},                  # the programs: each wires the floors below together
    {"duo.api", "duo.bench"},     # what clients of duo-target see; the benchmark (runs the programs as processes)
    {"duo.target", "duo.draft"},  # each process's loop
    {"duo.models"},               # model files: catalog, pulls, files on disk
    {"duo"},                      # what both processes share: the modules at the top of the package
    {"duo.net"},                  # the transport: the wire, TLS, gRPC's options, timeouts, reconnecting
    {"duo.llama"},                # llama.cpp: a model and its contexts, devices, RPC, the vocabulary, the model thread
    {"duo.sampling"},             # the sampling math: numpy alone
]


def module_name(path: Path) -> str:
    parts = path.relative_to(DUO.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def duo_modules() -> dict[str, Path]:
    return {module_name(path): path for path in DUO.rglob("*.py")}


def owner(module: str) -> str:
    """The package a module belongs to: duo.target.pool.link -> duo.target; duo.net.wire -> duo.net; duo.lookup -> duo."""
    parts = module.split(".")
    package = ".".join(parts[:2])
    return package if len(parts) > 1 and (DUO / parts[1]).is_dir() and package != GENERATED else "duo"


def floor_of(package: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if package in floor)


def imported_duo_modules(path: Path, known: set[str]) -> set[str]:
    """Every duo module `path` imports, at the top or inside a function, as `import` or `from ... import`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from duo import wire` imports the module duo.net.wire; `from duo.x import y` imports duo.x.
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = duo_modules()
    known = set(modules)
    return {name: imported_duo_modules(path, known) - {"duo", name} for name, path in modules.items()}


def wrong_way_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for every import of a module from a floor above the importer's, or from another package on it."""
    return sorted(f"{module} -> {imported}" for module, imports in graph.items() for imported in imports
                  if owner(imported) != owner(module) and floor_of(owner(imported)) <= floor_of(owner(module)))


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


def test_the_floor_check_refuses_an_import_upwards_or_sideways_and_accepts_one_downwards():
    graph = {"duo.target.chain": {"duo.api.http", "duo.draft.session", "duo.target.pool.link", "duo.net.wire"},
             "duo.net.wire": {"duo.target.chain"}, "duo.cli.main": {"duo.models.hub", "duo.net.wire"}}
    assert wrong_way_imports(graph) == ["duo.net.wire -> duo.target.chain", "duo.target.chain -> duo.api.http",
                                        "duo.target.chain -> duo.draft.session"]


def test_duo_modules_import_each_other_without_a_circle():
    assert find_cycle(import_graph()) is None


def test_every_package_stands_on_a_floor_and_says_what_lives_there():
    floors = set().union(*FLOORS)
    for folder in DUO.iterdir():
        package = module_name(folder / "__init__.py")
        if not (folder / "__init__.py").is_file() or package == GENERATED:
            continue
        assert package in floors, f"{package}: put it on a floor of FLOORS"
        docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert docstring and "import" in docstring, f"{package}: say what lives there and what it may import"


def test_no_module_imports_a_floor_above_its_own_or_a_neighbour_on_its_floor():
    assert wrong_way_imports(import_graph()) == []


def test_the_generation_loops_reach_no_endpoint_program_or_bench():
    graph = import_graph()
    for module in graph:
        if owner(module) in ("duo.target", "duo.draft"):
            above = {m for m in reachable(graph, module) if owner(m) in ("duo.api", "duo.cli", "duo.bench")}
            assert not above, (module, above)


def test_every_module_stays_short_enough_to_read():
    long = {name: n for name, path in duo_modules().items()
            if not name.startswith(GENERATED) and (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"


def test_every_console_script_runs_a_main_of_the_programs_floor():
    section = ROOT.joinpath("pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
    scripts = dict(re.findall(r'^([\w-]+) = "([\w.]+:\w+)"', section, re.MULTILINE))
    assert set(scripts) == {"duo", "duo-draft", "duo-target"}
    for name, target in scripts.items():
        module, function = target.split(":")
        assert owner(module) == "duo.cli", f"{name}: a program's entry lives in duo/cli"
        assert callable(getattr(importlib.import_module(module), function)), name
