"""The target's HTTP API: its app (app), what every request passes first (gate), the routes of each protocol (openai,
llama_server, anthropic, responses), the reading and answer of any generation (answering), the streams that outlive
their handlers (streams) and the shape each error is written in (errors)."""

from duo.api.http.app import create_app, http_server

__all__ = ["create_app", "http_server"]
