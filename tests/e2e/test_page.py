"""The chat page at / in a real browser (headless Chromium, tests/helpers/browser.py): a prompt typed and sent streams an
answer coloured by where its tokens came from, the panel shows the answer's own stats and the server's, with the API
key, over TLS and without a draft alike."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from helpers.browser import CHROMIUM, Browser
from helpers.pki import write_pki
from helpers.processes import Process, start
from helpers.http import scrape

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (scripts/test.sh installs Debian's where it can)")
KEY = "page-key"
PROMPT = "Write a short poem about two models that take turns."
LAST_ANSWER = "[...document.querySelectorAll('.message.assistant .answer')].pop()"


@pytest.fixture(scope="module")
def served_with_key(tiny_target: Path, served_draft: Process, process_logs: Path) -> Iterator[Process]:
    """duo-target with an API key, speculating with the draft at every step (--sync 4)."""
    process = start("duo.cli.target", ["--model", str(tiny_target), "--peer", served_draft.address, "--sync", "4",
                                       "--api-key", KEY], process_logs, http=True)
    deadline = time.monotonic() + 30
    while httpx.get(f"{process.http_url}/health").json()["draft"] != "connected":  # public: no key needed
        assert time.monotonic() < deadline, "the draft never connected"
        time.sleep(0.1)
    yield process
    process.stop()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    opened = Browser(tmp_path / "profile")
    yield opened
    opened.close()


def open_settings(browser: Browser) -> None:
    if not browser.evaluate("document.getElementById('settings').open"):
        browser.click("#settings summary")


def ask(browser: Browser, prompt: str, max_tokens: int) -> dict:
    """Type the prompt and click Send, as a user; the answer's record once it finished."""
    open_settings(browser)
    browser.type("#max-tokens", str(max_tokens))
    browser.type("#prompt", prompt)
    browser.click("#send")
    return answered(browser)


def answered(browser: Browser) -> dict:
    return json.loads(browser.wait_for("window.duoPage.last && !window.duoPage.controller && "
                                       "JSON.stringify(window.duoPage.last)"))


def stat(browser: Browser, id_: str) -> tuple[str, str]:
    """A number of the panel: (its text, the value it shows)."""
    return tuple(browser.evaluate(f"[document.getElementById('{id_}').textContent, "
                                  f"document.getElementById('{id_}').dataset.value]"))


def shown_sources(browser: Browser) -> list[list[str]]:
    """The answer's spans on the page: [text, data-source]."""
    return browser.evaluate(f"[...{LAST_ANSWER}.querySelectorAll('span[data-source]')]"
                            ".map(span => [span.textContent, span.dataset.source])")


def check_request_panel(browser: Browser, record: dict) -> None:
    """The panel's numbers are the answer's last chunk's: its duo_stats and usage."""
    stats, usage = record["stats"], record["usage"]
    assert stat(browser, "req-tokens") == (str(usage["completion_tokens"]), str(usage["completion_tokens"]))
    text, value = stat(browser, "req-tps")
    assert float(value) == stats["tokens_per_second"] and abs(float(text) - stats["tokens_per_second"]) <= 0.05
    text, value = stat(browser, "req-per-step")
    per_step = stats["generated_tokens"] / stats["verify_steps"]
    assert float(value) == pytest.approx(per_step) and abs(float(text) - per_step) <= 0.005
    assert stat(browser, "req-draft")[1] == ("1" if stats["draft_connected"] else "0")
    # The steps the stream told add up to the answer's tokens and steps.
    assert sum(len(step) for step in record["steps"]) == usage["completion_tokens"] == stats["generated_tokens"]
    assert len(record["steps"]) == stats["verify_steps"]


def test_a_prompt_sent_from_the_page_streams_an_answer_coloured_by_source_and_the_panel_shows_its_stats(
        browser, served_with_key, tmp_path):
    browser.open(f"{served_with_key.http_url}/")  # the page needs no key
    browser.wait_for("document.getElementById('model').textContent")
    browser.type("#prompt", PROMPT)
    browser.click("#send")
    # Without the key the server refuses, and the page says where to enter it.
    assert "key" in browser.wait_for("!document.getElementById('error').hidden && "
                                     "document.getElementById('error').textContent")
    open_settings(browser)
    browser.type("#api-key", KEY)
    browser.type("#max-tokens", "48")
    browser.click("#regenerate")  # the refused answer again, now with the key
    record = answered(browser)

    assert record["finish"] == "length" and record["content"]
    assert browser.evaluate("localStorage.getItem('duo.apiKey')") == KEY
    shown = shown_sources(browser)
    if "```" not in record["content"]:  # fence lines are not shown: elsewhere the spans spell the answer
        assert "".join(text for text, _ in shown) == record["content"]
    assert {source for _, source in shown} <= {"draft", "lookup", "grammar", "target"}
    assert any(source == "draft" for _, source in shown), "no accepted draft marked on the page"
    stats = record["stats"]
    assert stats["draft_connected"] and stats["draft_tokens_accepted"] > 0
    assert sum(source != "target" for step in record["steps"] for source in step) == stats["draft_tokens_accepted"]
    check_request_panel(browser, record)
    accepted = stat(browser, "req-acceptance")
    assert float(accepted[1]) == pytest.approx(stats["draft_tokens_accepted"] / stats["draft_tokens_verified"])

    # The server's side, from /metrics (no other request runs on this target meanwhile).
    browser.wait_for("document.getElementById('srv-draft').dataset.value === 'connected' && "
                     "document.getElementById('srv-per-step').dataset.value !== ''", timeout=10)
    metrics = scrape(served_with_key)
    per_step = (metrics[("duo:spec_decode_num_emitted_tokens_total", ())]
                / metrics[("duo:spec_decode_num_steps_total", ())])
    browser.wait_for(f"Math.abs(Number(document.getElementById('srv-per-step').dataset.value) - {per_step}) < 1e-9",
                     timeout=10)
    assert "connected" in stat(browser, "srv-draft")[0]
    assert browser.screenshot(tmp_path / "page.png").stat().st_size > 10_000


def test_without_a_draft_the_page_says_the_target_decodes_alone(browser, served_alone, tmp_path):
    browser.open(f"{served_alone.http_url}/")
    record = ask(browser, PROMPT, 24)
    assert record["content"] and not record["stats"]["draft_connected"]
    # No draft model's tokens: the target's own, and the context lookup's (it proposes without a draft too).
    assert {source for _, source in shown_sources(browser)} <= {"target", "lookup"}
    check_request_panel(browser, record)
    assert "decoded alone" in stat(browser, "req-draft")[0]
    assert stat(browser, "req-speculation")[0] == "off (no draft)"
    browser.wait_for("document.getElementById('srv-draft').dataset.value === 'none' && "
                     "document.getElementById('srv-per-step').dataset.value !== ''", timeout=10)
    assert "decodes alone" in stat(browser, "srv-draft")[0]
    assert "decoding alone" in browser.evaluate("document.getElementById('server-state').textContent")
    browser.screenshot(tmp_path / "page-alone.png")


def test_without_metrics_the_page_says_how_to_turn_them_on(browser, tiny_target, process_logs):
    process = start("duo.cli.target", ["--model", str(tiny_target)], process_logs, http=True, metrics=False)
    try:
        browser.open(f"{process.http_url}/")
        assert browser.wait_for("document.getElementById('server-state').textContent.includes('--metrics')",
                                timeout=10)
    finally:
        process.stop()


def test_stop_ends_a_long_answer_where_it_is_and_the_server_stops_generating_it(browser, served_with_key):
    browser.open(f"{served_with_key.http_url}/")
    open_settings(browser)
    browser.type("#api-key", KEY)
    browser.type("#max-tokens", "3000")  # seconds of work, even for the tiny models
    browser.type("#prompt", PROMPT)
    browser.click("#send")
    browser.wait_for(f"{LAST_ANSWER}.textContent.length > 0")
    browser.click("#stop")
    record = answered(browser)
    assert record["status"] == "stopped" and record["finish"] is None and record["stats"] is None
    assert browser.evaluate("document.getElementById('send').disabled") is False
    deadline = time.monotonic() + 10
    while httpx.get(f"{served_with_key.http_url}/health").json()["requests_running"]:
        assert time.monotonic() < deadline, "the stopped answer is still being generated"
        time.sleep(0.1)


def spki_pin(certificate: Path) -> str:
    """Chromium's pin of a certificate's key: base64 of the SHA-256 of its SubjectPublicKeyInfo."""
    key = x509.load_pem_x509_certificate(certificate.read_bytes()).public_key()
    return base64.b64encode(hashlib.sha256(key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo))
                            .digest()).decode()


def test_the_page_works_over_the_apis_own_tls_with_its_key(tiny_target, process_logs, tmp_path):
    (tmp_path / "pki").mkdir()
    pki = write_pki(tmp_path / "pki")
    process = start("duo.cli.target", ["--model", str(tiny_target), "--tls-cert", str(pki.server_cert),
                                       "--tls-key", str(pki.server_key), "--api-key", KEY], process_logs, http=True,
                    credentials=grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes()))
    # The browser trusts exactly the server's key (the test CA is in no trust store).
    browser = Browser(tmp_path / "profile", (f"--ignore-certificate-errors-spki-list={spki_pin(pki.server_cert)}",))
    try:
        assert process.http_url.startswith("https://")
        browser.open(f"{process.http_url}/")
        open_settings(browser)
        browser.type("#api-key", KEY)
        record = ask(browser, PROMPT, 16)
        assert record["finish"] == "length" and record["content"] and record["usage"]["completion_tokens"] == 16
        check_request_panel(browser, record)
        browser.wait_for("document.getElementById('srv-draft').dataset.value === 'none'", timeout=10)
    finally:
        browser.close()
        process.stop()
