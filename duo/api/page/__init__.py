"""The chat page duo-target serves at / (as llama-server serves its own): the static files of this folder, read
once, no build step, nothing fetched from elsewhere. The page talks to duo's own /v1/chat/completions (with the
`duo_sources` extension) and reads /metrics; it and its files are public, the API calls carry the key."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

# Path -> (file of this folder, media type).
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/page/page.js": ("page.js", "text/javascript; charset=utf-8"),
         "/page/page.css": ("page.css", "text/css; charset=utf-8")}
PAGE_PATHS = frozenset(FILES)
# The page runs its own script and style only and talks to this server only: a model's text can never run as
# script there, even where the page had a bug that put it into the document as markup.
HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                      "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                      "form-action 'none'; frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def add_page_routes(app: FastAPI) -> None:
    """GET / and the page's files."""
    for path, (name, media_type) in FILES.items():
        body = resources.files(__name__).joinpath(name).read_bytes()
        app.add_api_route(path, _file_route(body, media_type), methods=["GET"], include_in_schema=False)


def _file_route(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def serve() -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)

    return serve
