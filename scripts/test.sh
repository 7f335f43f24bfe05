#!/usr/bin/env bash
# Set up and run the test suite (no downloads: tests generate tiny models). Extra arguments go to pytest.
# pytest exits 5 when it collected no tests; with `set -e` that fails this script, as it should.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
