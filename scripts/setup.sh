#!/usr/bin/env bash
# Create .venv (if missing) and install duo with its dev extras into it.
# llama-cpp-python is compiled from source the first time (about 6 minutes on 2 cores), with ggml's RPC
# backend (duo-target --rpc, duo rpc-server) and any CMAKE_ARGS you add for a GPU (see README.md). The
# wheel is kept in ~/.cache/duo/wheels under a name derived from those arguments, so later installs
# take seconds. pip's own wheel cache cannot be used for this: it would hand back a wheel built with
# other CMAKE_ARGS (without RPC, say), since it keys wheels by the source package alone.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_CPP_PYTHON=0.3.36  # as pinned in pyproject.toml
export CMAKE_ARGS="-DGGML_RPC=on${CMAKE_ARGS:+ $CMAKE_ARGS}"
pip() { .venv/bin/python -m pip --quiet --disable-pip-version-check "$@"; }
has_rpc() { .venv/bin/python -c "import llama_cpp, sys; sys.exit(not llama_cpp.llama_supports_rpc())" 2>/dev/null; }

[ -x .venv/bin/python ] || python3 -m venv .venv
if ! has_rpc; then
    wheels="${DUO_WHEEL_CACHE:-$HOME/.cache/duo/wheels}/$(echo "$LLAMA_CPP_PYTHON $CMAKE_ARGS" | sha256sum | cut -c1-12)"
    if ! compgen -G "$wheels/llama_cpp_python-$LLAMA_CPP_PYTHON-*.whl" >/dev/null; then
        echo "building llama-cpp-python $LLAMA_CPP_PYTHON with CMAKE_ARGS=\"$CMAKE_ARGS\" (about 6 minutes on 2 cores) ..."
        pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON" -w "$wheels"
    fi
    pip install --force-reinstall --no-deps "$wheels"/llama_cpp_python-"$LLAMA_CPP_PYTHON"-*.whl
fi
pip install -e ".[dev]"
has_rpc || { echo "llama-cpp-python has no RPC backend; remove $HOME/.cache/duo/wheels and run again" >&2; exit 1; }
