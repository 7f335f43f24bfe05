"""CORS with guards of duo's own: a public page is let reach a server on a private network (Chrome's private network
access) only where the --cors-origin list names it or an API key stands; with a list, a request from another origin
is refused before it runs, preflighted or not (a form's text/plain POST), while the server's own page and clients
that are no browser (no Origin) go on as before."""

from __future__ import annotations

import httpx
import pytest

from helpers.asgi import SERVER, asgi_call, unloaded_app

PAGE = "https://page.example"  # a public page
ALLOWED = "http://allowed.example:3000"
PRIVATE_NETWORK = "access-control-allow-private-network"


def preflight(app, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    """Chrome's preflight for a public page's fetch to a server on a private network."""
    return asgi_call(app, "OPTIONS", path, {"Origin": origin, "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "content-type",
                                            "Access-Control-Request-Private-Network": "true"})


def test_without_a_key_or_a_list_a_public_page_is_not_let_reach_the_private_network():
    answer = preflight(unloaded_app(), PAGE)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == PAGE  # CORS as before
    assert PRIVATE_NETWORK not in answer.headers


@pytest.mark.parametrize("api_key, origins, origin", [
    ("sekrit", None, PAGE), ("sekrit", ["*"], PAGE), (None, [ALLOWED], ALLOWED)],
    ids=["a key", "a key and any origin", "the origin on the list"])
def test_a_key_or_the_origin_named_on_the_list_lets_a_page_reach_the_private_network(api_key, origins, origin):
    answer = preflight(unloaded_app(api_key, origins), origin)
    assert answer.status_code == 200 and answer.headers[PRIVATE_NETWORK] == "true"


def test_any_origin_on_the_list_guards_nothing_without_a_key():
    assert PRIVATE_NETWORK not in preflight(unloaded_app(origins=["*"]), PAGE).headers


def test_with_a_list_a_simple_post_from_another_origin_is_refused_before_it_runs():
    # A form on another site posts text/plain: no preflight, and before, the request ran (its answer unread).
    app = unloaded_app(origins=[ALLOWED])
    answer = asgi_call(app, "POST", "/completion", {"Origin": PAGE, "Content-Type": "text/plain"},
                       b'{"prompt": "hi", "n_predict": 8}')
    assert answer.status_code == 403 and "access-control-allow-origin" not in answer.headers
    error = answer.json()["error"]
    assert error["code"] == "origin_not_allowed" and f"--cors-origin {PAGE}" in error["message"]
    assert asgi_call(app, "GET", "/slots", {"Origin": PAGE}).status_code == 403


def test_a_refusal_on_the_messages_api_is_in_anthropics_shape():
    answer = asgi_call(unloaded_app(origins=[ALLOWED]), "POST", "/v1/messages", {"Origin": PAGE}, b"{}")
    assert answer.status_code == 403 and answer.json()["type"] == "error"
    assert answer.json()["error"]["type"] == "permission_error" and PAGE in answer.json()["error"]["message"]


def test_with_a_list_the_servers_own_page_and_clients_without_an_origin_go_on():
    app = unloaded_app(origins=[ALLOWED])
    own_page = asgi_call(app, "POST", "/tokenize", {"Origin": SERVER, "Content-Type": "application/json"},
                         b'{"content": "hi"}')
    no_browser = asgi_call(app, "POST", "/tokenize", {"Content-Type": "application/json"}, b'{"content": "hi"}')
    listed = asgi_call(app, "POST", "/tokenize", {"Origin": ALLOWED, "Content-Type": "application/json"},
                       b'{"content": "hi"}')
    for answer in (own_page, no_browser, listed):  # past the CORS guard: the model is still loading
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_loading"
    assert listed.headers["access-control-allow-origin"] == ALLOWED


def test_an_origin_that_only_looks_like_the_servers_is_another():
    app = unloaded_app(origins=[ALLOWED])
    for origin in ("https://duo:8000", "http://duo:8001", "http://duo", "null"):
        assert asgi_call(app, "GET", "/v1/models", {"Origin": origin}).status_code == 403, origin
