#!/usr/bin/env bash
# Create .venv (if missing) and install duo with its dev extras into it.
# llama-cpp-python is compiled from source the first time (about 6 minutes on 2 cores), with ggml's RPC
# backend (duo-target --rpc, duo rpc-server), without ggml's AMX kernels (they crash on Intel Xeons, see
# scripts/llama_build.py) and with any CMAKE_ARGS you add for a GPU (see README.md). The wheel is kept in
# ~/.cache/duo/wheels under a key of those flags, so later installs take seconds; CMAKE_ARGS left unset
# keeps the build installed now (a CUDA build stays a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || {
    echo "duo needs Python 3.10 or newer; $PYTHON is $("$PYTHON" --version 2>&1 || echo missing). Set PYTHON=/path/to/python3.1x" >&2
    exit 1
}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv 2>/dev/null && .venv/bin/python -m pip --version >/dev/null 2>&1 || {
        rm -rf .venv
        echo "$PYTHON cannot create a virtual environment with pip: install its venv module (Debian/Ubuntu: apt install python3-venv)" >&2
        exit 1
    }
fi
"$PYTHON" scripts/llama_build.py wheel --venv .venv
.venv/bin/python -m pip --quiet --disable-pip-version-check install -e ".[dev]"
