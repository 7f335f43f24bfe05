"""CORS as llama-server answers it (its tools/server/tests/unit/test_security.py): the header names as it writes them,
"*" for the headers a preflight may send, and its --cors-origins keyword `localhost` (any origin on this machine,
no other), with duo's guard standing for every origin off the list."""

from __future__ import annotations

import pytest

from duo.cli.llama_launch import cors_origins
from helpers.asgi import asgi_call, unloaded_app
from helpers.flags import target_flags

KEY = "sk-this-is-the-secret-key"
LOCAL_ORIGINS = ["http://localhost", "http://localhost:8080", "https://localhost:8443", "http://127.0.0.1",
                 "http://127.0.0.1:3000", "http://[::1]", "http://[::1]:3000"]
FOREIGN_ORIGINS = ["http://web.mydomain.fr", "http://evil.com", "http://notlocalhost", "http://localhost.evil.com",
                   "http://127.0.0.1.evil.com", "ftp://localhost", "localhost", "http://[::1", "null"]


def preflight(app, origin: str) -> dict[str, str]:
    """The suite's preflight (a POST with an Authorization header), its answer's headers as a plain dict, named as
    they were sent: what the suite reads (`dict(response.headers)` of requests)."""
    answer = asgi_call(app, "OPTIONS", "/completions", {"Origin": origin, "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": "Authorization"})
    assert answer.status_code == 200
    return {name.decode(): value.decode() for name, value in answer.headers.raw}


@pytest.mark.parametrize("origin, header, value", [
    ("localhost", "Access-Control-Allow-Origin", "localhost"),
    ("web.mydomain.fr", "Access-Control-Allow-Origin", "web.mydomain.fr"),
    ("origin", "Access-Control-Allow-Credentials", "true"),
    ("web.mydomain.fr", "Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS"),
    ("web.mydomain.fr", "Access-Control-Allow-Headers", "*"),
])
def test_a_preflight_names_its_headers_as_llama_server_writes_them(origin, header, value):
    assert preflight(unloaded_app(KEY), origin)[header] == value


def test_an_answer_from_any_origin_names_its_cors_headers_as_llama_server_writes_them():
    answer = asgi_call(unloaded_app(KEY), "GET", "/v1/models", {"Origin": "http://page.example"})
    headers = {name.decode(): value.decode() for name, value in answer.headers.raw}
    assert headers["Access-Control-Allow-Origin"] == "http://page.example"
    assert headers["Access-Control-Allow-Credentials"] == "true"


def test_an_origin_the_list_names_may_send_the_headers_it_asks_for_authorization_among_them():
    # "*" never covers Authorization in a browser: a page the operator listed sends its key there.
    listed = preflight(unloaded_app(KEY, ["http://app.example"]), "http://app.example")
    assert listed["Access-Control-Allow-Headers"] == "Authorization"
    local = preflight(unloaded_app(KEY, ["localhost"]), "http://localhost:5173")
    assert local["Access-Control-Allow-Headers"] == "Authorization"


@pytest.mark.parametrize("origin", LOCAL_ORIGINS)
def test_the_localhost_keyword_reflects_every_origin_on_this_machine(origin):
    app = unloaded_app(KEY, cors_origins(target_flags("--cors-origins localhost")))
    assert preflight(app, origin)["Access-Control-Allow-Origin"] == origin
    answer = asgi_call(app, "POST", "/completion", {"Origin": origin})
    assert answer.status_code == 401 and answer.headers["access-control-allow-origin"] == origin  # it ran: no key


@pytest.mark.parametrize("origin", FOREIGN_ORIGINS)
def test_the_localhost_keyword_gives_other_origins_no_cors_headers_and_duos_guard_refuses_them(origin):
    app = unloaded_app(KEY, cors_origins(target_flags("--cors-origins localhost")))
    assert not any(name.lower().startswith("access-control-") for name in preflight(app, origin))
    refused = asgi_call(app, "POST", "/completion", {"Origin": origin, "Content-Type": "text/plain"}, b"{}")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed"


def test_the_localhost_keyword_mixes_with_named_origins_and_duos_own_flag():
    origins = cors_origins(target_flags("--cors-origin http://a.example --cors-origins localhost,http://b.example"))
    app = unloaded_app(KEY, origins)
    for origin in ("http://a.example", "http://b.example", "http://127.0.0.1:9000"):
        assert preflight(app, origin)["Access-Control-Allow-Origin"] == origin
    assert "Access-Control-Allow-Origin" not in preflight(app, "http://c.example")
