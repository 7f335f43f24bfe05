"""The target's HTTP API: its app (app), what every request passes first (gate), the routes of each protocol (routes:
OpenAI's and llama-server's; anthropic; responses), the answer of any generation (answering), the streams that
outlive their handlers (streams) and the shape each error is written in (errors)."""

from duo.api.http.app import create_app, http_server
from duo.api.http.routes import OpenAIApi

__all__ = ["OpenAIApi", "create_app", "http_server"]
