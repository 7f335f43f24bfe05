"""A page on another origin calls duo-target from a real browser (headless Chromium): the preflight its key header
causes is answered, and its fetches read the answers; a page on an origin off --cors-origin cannot."""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from duo.net.listening import free_port
from helpers.processes import Process, start

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (scripts/test.sh installs Debian's where it can)")
KEY = "browser-key"

# X-Api-Key is no CORS-safelisted header and application/json no safelisted type: each fetch is preflighted.
PAGE = """<!doctype html><html><body><pre id="out">pending</pre><script>
const duo = "%(duo)s", out = {};
fetch(duo + "/v1/models", {headers: {"X-Api-Key": "%(key)s"}})
  .then(r => r.json()).then(j => { out.model = j.data[0].id;
    return fetch(duo + "/v1/chat/completions", {method: "POST",
      headers: {"Content-Type": "application/json", "Authorization": "Bearer %(key)s"},
      body: JSON.stringify({model: "any", max_tokens: 3, messages: [{role: "user", content: "hi"}]})}); })
  .then(r => r.json()).then(j => { out.finish = j.choices[0].finish_reason; out.tokens = j.usage.completion_tokens;
    document.getElementById("out").textContent = "OK " + JSON.stringify(out); })
  .catch(e => { document.getElementById("out").textContent = "FAILED " + e; });
</script></body></html>"""


def serve_page(folder: Path) -> tuple[str, http.server.ThreadingHTTPServer]:
    port = free_port()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{port}", server


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """Two page origins: the first on duo-target's --cors-origin list, the second not."""
    folder = tmp_path_factory.mktemp("pages")
    (allowed, first), (other, second) = serve_page(folder), serve_page(folder)
    yield allowed, other, folder
    first.shutdown()
    second.shutdown()


@pytest.fixture(scope="module")
def served_with_key(tiny_target: Path, process_logs: Path, pages) -> Iterator[Process]:
    allowed, _, _ = pages
    process = start("duo.cli.target", ["--model", str(tiny_target), "--api-key", KEY, "--cors-origin", allowed],
                    process_logs, http=True)
    yield process
    process.stop()


def page_result(origin: str, folder: Path, duo_url: str, tmp_path: Path) -> str:
    """What the page wrote once its fetches settled, as headless Chromium rendered it."""
    (folder / "page.html").write_text(PAGE % {"duo": duo_url, "key": KEY})
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=30000", "--dump-dom",
                          f"{origin}/page.html"], capture_output=True, text=True, timeout=120).stdout
    found = re.search(r'<pre id="out">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return found.group(1)


def test_a_page_on_an_allowed_origin_reads_duos_answers_through_its_preflights(pages, served_with_key, tmp_path):
    allowed, _, folder = pages
    result = page_result(allowed, folder, served_with_key.http_url, tmp_path)
    assert result.startswith("OK "), result
    assert '"finish":"length"' in result and '"tokens":3' in result


def test_a_page_on_an_origin_off_the_list_is_stopped_by_the_browser(pages, served_with_key, tmp_path):
    _, other, folder = pages
    result = page_result(other, folder, served_with_key.http_url, tmp_path)
    assert result.startswith("FAILED TypeError"), result  # the browser's own refusal: no CORS answer for it
