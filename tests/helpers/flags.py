"""duo-target's command line parsed as its entry point parses it, for the tests of what a flag sets."""

from __future__ import annotations

import argparse

from duo.cli.target import build_parser


def target_flags(line: str) -> argparse.Namespace:
    """`line` split at white space (no shell quoting: a JSON value stays as written) and parsed as duo-target's."""
    return build_parser().parse_args(line.split())
