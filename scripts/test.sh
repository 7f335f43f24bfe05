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
# One pytest worker per core (DUO_TEST_WORKERS to change it), a test file per worker at a time (its processes and
# fixtures once); then, alone, the tests marked serial: they time the server under a load of their own (a /health
# answer within 0.25 s), which another worker's load beside them would make a measure of the machine.
WORKERS="${DUO_TEST_WORKERS:-$(nproc)}"
.venv/bin/python -m pytest -n "$WORKERS" --dist loadfile -m "not serial"
.venv/bin/python -m pytest -m serial
exec scripts/conformance.sh --no-download
