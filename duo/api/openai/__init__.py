"""OpenAI's /v1/completions and /v1/chat/completions: their bodies (bodies), answers (answers) and errors (errors)."""
