"""TLS on the client endpoint and on the target-draft link (mutual), and the API key, with real processes."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.pki import Pki, write_pki
from helpers.processes import generate as plain_generate
from helpers.processes import start

API_KEY = "test-key-1234"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return write_pki(tmp_path_factory.mktemp("pki"))


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def credentials(pki: Pki) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())


@pytest.fixture(scope="module")
def mtls_draft(tiny_draft, pki, process_logs):
    """duo-draft accepting only targets with a certificate from the test CA."""
    process = start("duo.cli.draft", ["--model", str(tiny_draft), "--tls-cert", str(pki.server_cert),
                                  "--tls-key", str(pki.server_key), "--tls-ca", str(pki.ca)], process_logs)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def secured(tiny_target, mtls_draft, pki, process_logs):
    """duo-target with TLS and an API key for clients, and mutual TLS to its draft."""
    process = start("duo.cli.target", ["--model", str(tiny_target), "--peer", mtls_draft.address,
                                   "--peer-tls-ca", str(pki.ca), "--peer-tls-cert", str(pki.client_cert),
                                   "--peer-tls-key", str(pki.client_key), "--tls-cert", str(pki.server_cert),
                                   "--tls-key", str(pki.server_key), "--api-key", API_KEY],
                    process_logs, http=True, credentials=credentials(pki))
    yield process
    process.stop()


def generate(process, pki: Pki, *, api_key: str | None = API_KEY, max_tokens: int = 8) -> pb.GenerateResponse:
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with grpc.secure_channel(process.address, credentials(pki)) as channel:
        responses = list(pb_grpc.TargetStub(channel).Generate(
            pb.GenerateRequest(prompt="Once upon a time", max_tokens=max_tokens), metadata=metadata, timeout=30))
    return responses[-1]


def test_the_draft_link_works_over_mutual_tls(secured, pki):
    for _ in range(100):  # the link connects in the background, and its first session warms the draft up
        last = generate(secured, pki, max_tokens=32)
        if last.stats.draft_connected and last.stats.draft_tokens_received:
            break
    assert last.stats.draft_connected and last.stats.draft_tokens_received > 0


def test_a_target_without_a_client_certificate_is_refused_by_a_mutual_tls_draft(mtls_draft, pki):
    with grpc.secure_channel(mtls_draft.address, credentials(pki)) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.DraftStub(channel).Handshake(pb.Hello(protocol="duo/2"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_clients_without_the_ca_cannot_connect(secured, pki):
    with grpc.insecure_channel(secured.address) as channel, pytest.raises(grpc.RpcError):
        list(pb_grpc.TargetStub(channel).Generate(pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=5))
    untrusting = grpc.ssl_channel_credentials(root_certificates=pki.other_ca.read_bytes())
    with grpc.secure_channel(secured.address, untrusting) as channel, pytest.raises(grpc.RpcError) as refused:
        list(pb_grpc.TargetStub(channel).Generate(pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=5))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{secured.http_url}/health", verify=trusting(pki.other_ca))
    assert httpx.get(f"{secured.http_url}/health", verify=trusting(pki.ca)).status_code == 200


def test_calls_without_the_right_api_key_are_refused_on_both_endpoints(secured, pki):
    for key in (None, "wrong"):
        with pytest.raises(grpc.RpcError) as refused:
            generate(secured, pki, api_key=key)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in refused.value.details()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path in (("POST", "/v1/completions"), ("GET", "/props"), ("POST", "/v1/messages")):
            response = httpx.request(method, f"{secured.http_url}{path}", headers=headers, verify=trusting(pki.ca),
                                     json={"prompt": "hi"})
            assert response.status_code == 401
            error = response.json()["error"]
            assert error.get("code") == "invalid_api_key" or error["type"] == "authentication_error"  # Anthropic's
    with grpc.secure_channel(secured.address, credentials(pki)) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.TargetStub(channel).Tokenize(pb.TokenizeRequest(prompt="hi"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert generate(secured, pki).finish_reason == "length"
    api = openai.OpenAI(base_url=f"{secured.http_url}/v1", api_key=API_KEY, max_retries=0,
                        http_client=httpx.Client(verify=trusting(pki.ca)))
    answer = api.chat.completions.create(model="tiny-target", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=4)
    assert answer.choices[0].finish_reason == "length"


def test_health_reflection_metrics_and_the_model_list_need_no_api_key(secured, pki):
    with grpc.secure_channel(secured.address, credentials(pki)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert httpx.get(f"{secured.http_url}/health", verify=trusting(pki.ca)).status_code == 200
    metrics = httpx.get(f"{secured.http_url}/metrics", verify=trusting(pki.ca))
    assert metrics.status_code == 200 and "duo:generation_tokens_total" in metrics.text
    models = httpx.get(f"{secured.http_url}/v1/models", verify=trusting(pki.ca))  # public, as llama-server's
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny-target"


def test_duo_generate_takes_the_key_from_the_environment_and_the_ca_from_a_flag(secured, pki):
    command = [sys.executable, "-m", "duo.cli.main", "generate", "--endpoint", secured.address, "--prompt", "hi",
               "--max-tokens", "4", "--json", "--tls-ca", str(pki.ca)]
    environment = {k: v for k, v in os.environ.items() if k != "DUO_API_KEY"}
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60, env=environment)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    done = subprocess.run(command, capture_output=True, text=True, timeout=60,
                          env={**environment, "DUO_API_KEY": API_KEY})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["finish_reason"] == "length"
    with_flag = subprocess.run([*command, "--api-key", API_KEY], capture_output=True, text=True, timeout=60,
                               env=environment)
    assert with_flag.returncode == 0, with_flag.stderr


def test_a_certificate_without_its_key_is_refused_at_start_with_the_flag_named(tiny_target, pki):
    completed = subprocess.run([sys.executable, "-m", "duo.cli.target", "--model", str(tiny_target),
                                "--tls-cert", str(pki.server_cert)], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 1 and "--tls-cert/--tls-key" in completed.stderr
    completed = subprocess.run([sys.executable, "-m", "duo.cli.target", "--model", str(tiny_target),
                                "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.client_key)],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 1 and "not a usable certificate and key" in completed.stderr


@pytest.mark.parametrize("case", ["the draft's certificate from another CA", "TLS on the draft only",
                                  "TLS on the target only"])
def test_a_link_whose_tls_does_not_match_leaves_the_target_decoding_alone_and_health_says_why(
        case, tiny_target, tiny_draft, target_model, pki, process_logs):
    draft_tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    draft = start("duo.cli.draft", ["--model", str(tiny_draft), *(draft_tls if case != "TLS on the target only"
                                                                        else [])], process_logs)
    trusted = {"the draft's certificate from another CA": ["--peer-tls-ca", str(pki.other_ca)],
               "TLS on the draft only": [], "TLS on the target only": ["--peer-tls-ca", str(pki.ca)]}[case]
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, *trusted],
                   process_logs, http=True)
    try:
        deadline = time.monotonic() + 30
        while not (body := httpx.get(f"{target.http_url}/health", timeout=10).json())["draft_error"]:
            assert time.monotonic() < deadline, body
            time.sleep(0.2)
        assert body["draft"] == "disconnected" and body["draft_error"].startswith("UNAVAILABLE"), body
        tokens, last = plain_generate(target.address, "Once upon a time", max_tokens=16)
        assert not last.stats.draft_connected and last.stats.draft_tokens_received == 0
        assert leaves_greedy_path_only_at_a_near_tie(target_model, "Once upon a time", tokens, 16)
        assert " connected; speculating" not in target.log()  # the link never came up
    finally:
        target.stop()
        draft.stop()
