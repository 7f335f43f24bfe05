"""The client examples in scripts/ run against a live duo-target."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def run(command: list[str], **env: str) -> subprocess.CompletedProcess:
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert completed.returncode == 0, completed.stderr
    return completed


def test_the_openai_example_streams_a_chat(served_alone):
    completed = run([sys.executable, str(SCRIPTS / "example_openai.py"), "--base-url", f"{served_alone.http_url}/v1",
                     "--max-tokens", "8"])
    assert completed.stdout.strip() and "8 completion tokens" in completed.stderr


def test_the_grpc_example_streams_a_completion(served_alone):
    completed = run([sys.executable, str(SCRIPTS / "example_grpc.py"), "--endpoint", served_alone.address,
                     "--max-tokens", "8"])
    assert completed.stdout.strip() and "tiny-target" in completed.stderr and "length: 8 tokens" in completed.stderr


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_the_curl_example_runs(served_alone):
    completed = run(["bash", str(SCRIPTS / "example_curl.sh")], BASE=served_alone.http_url)
    assert "data: [DONE]" in completed.stdout and "duo:spec_decode_num_drafts_total" in completed.stdout
