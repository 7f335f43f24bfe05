#!/usr/bin/env bash
# Set up and run the test suite (no model downloads: tests generate tiny models; tests/e2e/test_agents.py installs the
# three coding agents it runs from npm into ~/.cache/duo/agents once), then, on a whole run (no arguments: CI's),
# llama-server's own test suite against duo-target (scripts/conformance.sh --no-download: the suite's fast tests, on
# the tiny stand-in models; it fails on a test off scripts/conformance-expected.txt). Extra arguments go to pytest,
# and only pytest runs.
# pytest exits 5 when it collected no tests; with `set -e` that fails this script, as it should.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The browser tests drive Debian's Chromium: installed where this machine allows it (root with apt), else they skip.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
        || echo "test.sh: could not install chromium; the browser tests will skip" >&2
fi
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
.venv/bin/python -m pytest
exec scripts/conformance.sh --no-download
