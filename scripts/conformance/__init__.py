"""llama-server's test suite (llama.cpp's tools/server/tests) run against duo-target; here, the suite's pytest plugin.

scripts/conformance.sh drives the package; `python scripts/conformance SUBCOMMAND` runs one of its steps (__main__.py):

    models DIR                     write the tiny stand-in models into DIR (no download)             models.py
    serve LLAMA-SERVER-ARGS        the suite's `llama-server` (LLAMA_SERVER_BIN_PATH runs it): the     standin.py
                                   model it names resolved to a local file, then duo-target (with a
                                   duo-draft beside it in the draft pass) or the real llama-server
    report JUNIT EXPECTED [ACC]    the per-file table; exit 1 on a test off the expectations, or an   results.py
                                   expected "model:" failure that fails elsewhere than on llama-server
    compare LLAMA DUO EXPECTED     the tests llama-server passes and duo does not (two runs' junit)   results.py
    expect LLAMA DUO EXPECTED      rewrite the expectations from the two runs (the lead's refresh)     expectations.py

This module is the plugin (`pytest -p conformance`, with scripts/ on PYTHONPATH): it runs inside the suite's own
environment, so it imports nothing of duo.
"""

from __future__ import annotations

import os
import sys

import pytest


def pytest_sessionstart(session: object) -> None:
    """The suite's ServerPreset.load_all starts every preset once to download its model from the hub; the stand-in
    serves local files, so there is nothing to fetch (and presets of features duo lacks would stop the session)."""
    utils = sys.modules["utils"]
    utils.ServerPreset.load_all = staticmethod(lambda: None)


def worker_port(config: pytest.Config) -> str:
    """This pytest-xdist worker's port, from DUO_CONFORMANCE_PORT on (gw<n>: 10 n further, as the suite spaces them):
    the suite's own conftest starts every run at 8080, where two runs on one machine (or a developer's server) meet."""
    worker = getattr(config, "workerinput", {}).get("workerid")
    base = int(os.environ.get("DUO_CONFORMANCE_PORT", "8080"))
    return str(base + 10 * int(worker[2:]) if worker else base)


def pytest_configure(config: pytest.Config) -> None:
    """The port for the servers the suite's modules make as they are collected."""
    os.environ["PORT"] = worker_port(config)


@pytest.fixture(scope="session", autouse=True)
def duo_worker_port(configure_worker_port: None, request: pytest.FixtureRequest) -> None:
    """The port again after the suite's conftest has set its own (8080 + 10 n)."""
    os.environ["PORT"] = worker_port(request.config)
