"""duo's HTTP app in this process (its model not loaded, or a scripted one) and the clients that call it there."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable
from typing import Any

import httpx
from fastapi.testclient import TestClient
from starlette.types import ASGIApp

from duo.api.http import create_app
from duo.api.http.launch import LaunchSettings
from duo.api.serving.admit import Admission
from duo.api.serving.generate import Completions
from duo.api.serving.metrics import Metrics

SERVER = "http://duo:8000"  # the server as a browser reaches it: its own origin


def unloaded_app(api_key: str | None = None, origins: list[str] | None = None, names: list[str] | None = None,
                 launch: LaunchSettings = LaunchSettings()) -> ASGIApp:
    """The app, its model not loaded: CORS, the key, /metrics and the model list are answered before a model is
    needed."""
    metrics = Metrics()
    return create_app(Completions(Admission(1, 1), metrics, names or ["tiny-target"]), metrics, api_key,
                      cors_origins=origins, launch=launch)


def app_client(completions: Completions, api_key: str | None = None,
               raise_server_exceptions: bool = True) -> TestClient:
    """A TestClient of the app serving `completions` (a scripted model's, a failing one's); with
    raise_server_exceptions False a bug is answered as the server answers it, a 500."""
    return TestClient(create_app(completions, Metrics(), api_key), raise_server_exceptions=raise_server_exceptions)


def asgi_call(app: ASGIApp, method: str, path: str, headers: dict[str, str] | None = None,
              body: bytes | AsyncIterable[bytes] | None = None, base_url: str = SERVER,
              raise_app_exceptions: bool = True, json: Any = None) -> httpx.Response:
    """One request to `app` in this process, read whole: `body` as it is, or `json` encoded; `base_url` is the server
    as the client reaches it. With raise_app_exceptions False a bug is answered as the
    server answers it, a 500."""
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url=base_url) as client:
            return await client.request(method, path, headers=headers or {}, content=body, json=json)

    return asyncio.run(run())
