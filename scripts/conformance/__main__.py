"""`python scripts/conformance SUBCOMMAND ARGS`: a step of scripts/conformance.sh (the package's docstring lists them)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(SCRIPTS))  # run as a folder, the package is not on the path by itself

from conformance.expectations import rewrite  # noqa: E402
from conformance.models import write_models  # noqa: E402
from conformance.results import compare, report  # noqa: E402
from conformance.standin import serve  # noqa: E402


def main(argv: list[str]) -> int:
    command, *rest = argv
    if command == "serve":
        return serve(rest, dict(os.environ))
    if command == "models":
        write_models(Path(rest[0]), SCRIPTS.parent)
        return 0
    if command == "report":
        return report(Path(rest[0]), Path(rest[1]), Path(rest[2]) if len(rest) > 2 else None)
    if command == "compare":
        return compare(Path(rest[0]), Path(rest[1]), Path(rest[2]))
    if command == "expect":
        return rewrite(Path(rest[0]), Path(rest[1]), Path(rest[2]))
    print(f"conformance: unknown command {command!r} (serve, models, report, compare, expect)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
