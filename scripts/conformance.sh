#!/usr/bin/env bash
# llama-server's own test suite (llama.cpp's tools/server/tests, from the pinned llama-cpp-python's source) run
# unmodified against duo-target, through a stand-in `llama-server` (scripts/conformance/standin.py) that resolves the
# suite's models to local files (no hub download) and passes its flags on. Prints run / passed / failed / expected
# to fail per file and exits non-zero when a test off scripts/conformance-expected.txt fails, or a test expected
# to fail as it does on llama-server (a `model:` line) fails elsewhere on duo.
#
#   scripts/conformance.sh                    duo-target alone
#   scripts/conformance.sh --draft            every duo-target with a duo-draft attached (--peer)
#   scripts/conformance.sh --llama-server     the real llama-server (scripts/llama_build.py server), same models:
#                                             what it passes is what duo must pass
#   scripts/conformance.sh --no-download      no model download (CI's run): the suite's fast tests name only its tiny
#                                             models; a test naming a real one fails, saying so
#   scripts/conformance.sh --refresh          llama-server's run, then duo's, then the expectations rewritten from the
#                                             two (features kept; `model:` tests that fail on both at the same place);
#                                             prints what is left off, which the check fails on
#   scripts/conformance.sh [--draft] unit/test_completion.py -k stream   files and pytest arguments of your own
#
# Runs the suite's fast tests (-m "not slow", as its CI does without SLOW_TESTS) of the files of features duo has;
# the files the expectations list as not run test features duo does not have. DUO_CONFORMANCE_WORKERS pytest-xdist
# workers (default: the number of cores; each server gets its share of the cores), the first on port DUO_CONFORMANCE_PORT (default: one picked at random, so
# that two runs on one machine do not meet, below Linux's ephemeral ports, 32768 on, which any client's connection
# may hold), each next 10 further. Cached in ~/.cache/duo/conformance.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
VERSION=0.3.36  # llama-cpp-python, as pinned in pyproject.toml (scripts/llama_build.py builds duo and llama-server from it)
CACHE="${DUO_HOME:-$HOME/.cache/duo}/conformance"
EXPECTED="$REPO/scripts/conformance-expected.txt"
SERVER=duo
DRAFT=0
DOWNLOAD=1
while [ $# -gt 0 ]; do
    case "$1" in
        --draft) DRAFT=1; shift ;;
        --llama-server) SERVER="$(.venv/bin/python scripts/llama_build.py server)"; shift ;;
        --no-download) DOWNLOAD=0; shift ;;
        --refresh)
            shift
            runs="$(mktemp -d)"
            DUO_CONFORMANCE_KEEP="$runs/llama" "$REPO/scripts/conformance.sh" --llama-server "$@" || true
            DUO_CONFORMANCE_KEEP="$runs/duo" "$REPO/scripts/conformance.sh" "$@" || true
            exec .venv/bin/python scripts/conformance expect "$runs/llama/junit.xml" "$runs/duo/junit.xml" "$EXPECTED" ;;
        *) break ;;
    esac
done

# The suite and the templates it reads (../../../models/templates from its folder), from the sdist's llama.cpp.
SUITE="$CACHE/llama.cpp-$VERSION/tools/server/tests"
if [ ! -d "$SUITE/unit" ]; then
    mkdir -p "$CACHE"
    [ -f "$CACHE/llama_cpp_python-$VERSION.tar.gz" ] || .venv/bin/python -m pip download --quiet --no-deps \
        --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
    rm -rf "$CACHE/extract" && mkdir "$CACHE/extract"
    tar -xzf "$CACHE/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE/extract" \
        "llama_cpp_python-$VERSION/vendor/llama.cpp/tools/server/tests" \
        "llama_cpp_python-$VERSION/vendor/llama.cpp/models/templates"
    rm -rf "$CACHE/llama.cpp-$VERSION"
    mv "$CACHE/extract/llama_cpp_python-$VERSION/vendor/llama.cpp" "$CACHE/llama.cpp-$VERSION"
    rm -rf "$CACHE/extract"
fi
# The suite's requirements (and a per-test timeout, so that a hung server fails its test rather than the run).
VENV="$CACHE/venv"
if [ ! -x "$VENV/bin/pytest" ] || [ ! -f "$VENV/.requirements-$VERSION" ]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$SUITE/requirements.txt" pytest-timeout
    touch "$VENV/.requirements-$VERSION"
fi
# The models: the tiny random Qwen-tokenizer pair for the suite's tiny ones, Qwen2.5-Coder-0.5B for the real ones.
MODELS="$CACHE/models"
[ -f "$MODELS/tiny-draft.gguf" ] || .venv/bin/python scripts/conformance models "$MODELS"
# Only the suite's slow tests name a real model: a run without the download serves them none (the stand-in says so).
CHAT="$(.venv/bin/duo models path qwen2.5-coder-0.5b-instruct 2>/dev/null)" || CHAT=""
if [ -z "$CHAT" ] && [ "$DOWNLOAD" = 1 ]; then
    .venv/bin/duo models pull qwen2.5-coder-0.5b-instruct
    CHAT="$(.venv/bin/duo models path qwen2.5-coder-0.5b-instruct)"
fi
CHAT_DRAFT="$(.venv/bin/duo models path qwen2.5-coder-0.5b-instruct-q4_0 2>/dev/null)" || CHAT_DRAFT="$MODELS/tiny-draft.gguf"
# test_speculative downloads its draft into the suite's tmp/ unless it is there: the tiny draft stands in.
mkdir -p "$SUITE/tmp"
ln -sf "$MODELS/tiny-draft.gguf" "$SUITE/tmp/stories15M-q4_0.gguf"

# The stand-in llama-server the suite runs (LLAMA_SERVER_BIN_PATH).
STANDIN="$CACHE/llama-server"
printf '#!/bin/sh\nexec "%s" "%s" serve "$@"\n' "$REPO/.venv/bin/python" "$REPO/scripts/conformance" > "$STANDIN"
chmod +x "$STANDIN"

if [ $# -eq 0 ]; then
    # Every unit/ file but those the expectations say are not run.
    set -- $(cd "$SUITE" && ls unit/test_*.py | grep -v -x -F -f <(grep -v '^#' "$EXPECTED" | grep -v '::' \
        | sed -n 's/ |.*//p'))
fi
RUN="$(mktemp -d)"
trap 'rm -rf "$RUN"' EXIT
name=llama-server
if [ "$SERVER" = duo ]; then name=duo-target; fi
if [ "$DRAFT" = 1 ]; then name="$name with a duo-draft attached"; fi
echo "conformance: llama.cpp's server tests (llama-cpp-python $VERSION) against $name"
WORKERS="${DUO_CONFORMANCE_WORKERS:-$(nproc)}"
THREADS=$(( $(nproc) / (WORKERS > 0 ? WORKERS : 1) ))
[ "$THREADS" -gt 0 ] || THREADS=1
started=$(date +%s)
(
    cd "$SUITE"
    export LLAMA_SERVER_BIN_PATH="$STANDIN" DUO_CONFORMANCE_SERVER="$SERVER" DUO_CONFORMANCE_DRAFT="$DRAFT" \
        DUO_CONFORMANCE_TINY="$MODELS/tiny.gguf" DUO_CONFORMANCE_TINY_DRAFT="$MODELS/tiny-draft.gguf" \
        DUO_CONFORMANCE_CHAT="$CHAT" DUO_CONFORMANCE_CHAT_DRAFT="$CHAT_DRAFT" \
        DUO_CONFORMANCE_ACCEPTANCE="$RUN/acceptance.tsv" DUO_CONFORMANCE_THREADS="$THREADS" \
        PYTHONPATH="$REPO/scripts" \
        DUO_CONFORMANCE_PORT="${DUO_CONFORMANCE_PORT:-$((10000 + RANDOM % 1000 * 20))}" LLAMA_CACHE="$CACHE/hub-unused"
    "$VENV/bin/python" -m pytest -p conformance -q -m "not slow" --timeout 180 -p no:cacheprovider \
        -n "$WORKERS" --junitxml "$RUN/junit.xml" "$@" > "$RUN/pytest.log" 2>&1 || true
)
echo "ran in $(( $(date +%s) - started )) s (pytest's log and junit.xml: ${DUO_CONFORMANCE_KEEP:-not kept; set DUO_CONFORMANCE_KEEP=DIR})"
if [ -n "${DUO_CONFORMANCE_KEEP:-}" ]; then mkdir -p "$DUO_CONFORMANCE_KEEP" && cp "$RUN"/* "$DUO_CONFORMANCE_KEEP"; fi
[ -f "$RUN/junit.xml" ] || { tail -30 "$RUN/pytest.log"; exit 1; }
.venv/bin/python scripts/conformance report "$RUN/junit.xml" "$EXPECTED" "$RUN/acceptance.tsv"
