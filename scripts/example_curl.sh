#!/usr/bin/env bash
# duo-target's OpenAI-compatible HTTP API with curl (duo-target --http 8000 --metrics); BASE overrides the address.
set -euo pipefail
BASE="${BASE:-http://127.0.0.1:8000}"
AUTH=(-H "Authorization: Bearer ${DUO_API_KEY:-none}")  # checked only with duo-target --api-key

curl -sS "$BASE/health"; echo
curl -sS "${AUTH[@]}" "$BASE/v1/models"; echo

# A whole completion, ending before a blank line.
curl -sS "${AUTH[@]}" "$BASE/v1/completions" -H "Content-Type: application/json" \
  -d '{"prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0, "stop": ["\n\n"]}'
echo

# A chat, streamed as server-sent events ending in `data: [DONE]`.
curl -sSN "${AUTH[@]}" "$BASE/v1/chat/completions" -H "Content-Type: application/json" \
  -d '{"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 32, "stream": true}'

# Prometheus metrics (501 without --metrics, as llama-server's).
curl -sS "$BASE/metrics" | grep '^duo:spec_decode'
