"""The target's HTTP API: OpenAI's, Anthropic's and llama-server's endpoints (app), what every request passes
first (gate), the routes (routes) and the streams that outlive their handlers (streams)."""

from duo.api.http.app import create_app, http_server
from duo.api.http.routes import OpenAIApi

__all__ = ["OpenAIApi", "create_app", "http_server"]
