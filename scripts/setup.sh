#!/usr/bin/env bash
# Create .venv (if missing) and install duo with its dev extras into it.
# llama-cpp-python is compiled from source the first time (about 6 minutes on 2 cores); pip caches the
# wheel, so later installs take seconds. For a GPU build set CMAKE_ARGS first (see README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
