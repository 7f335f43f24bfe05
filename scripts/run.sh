#!/usr/bin/env bash
# Set up, pull the default model pair, and generate through duo-draft + duo-target on this machine.
# Extra arguments go to `duo demo` (e.g. --prompt "..." --max-tokens 512).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/duo demo "$@"
