"""Sampling parameters are checked as they travel to the draft (float32 and int32, proto/duo.proto): a value
that the wire would round into something else is a 400 / INVALID_ARGUMENT, never a failure further on."""

from __future__ import annotations

import grpc
import httpx
import pytest

from duo.net._proto import duo_pb2 as pb
from duo.sampling.params import SamplingParams
from helpers.processes import generate

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("field, value, words", [
    ("min_p", 0.99999999, ["min_p", "0.99999994", "float32"]),    # 1.0 in float32: no token would be kept
    ("temperature", 1e-50, ["temperature", "float32"]),            # 0 in float32: the draft would go greedy
    ("top_p", 1e-50, ["top_p", "float32"]),                        # 0 in float32, read as "unset" on the wire
    ("top_k", 2**31, ["top_k", "2147483647", "int32"]),            # beyond int32: protobuf refuses to encode it
], ids=["min_p rounding to 1", "temperature rounding to 0", "top_p rounding to 0", "top_k beyond int32"])
def test_a_value_the_wire_would_change_is_refused_naming_the_field(field, value, words):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{"temperature": 1.0, field: value}).validate()
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, min_p=0.99999994),  # the largest float32 below 1
    SamplingParams(temperature=1.0, top_k=2**31 - 1),
    SamplingParams(temperature=float(2**-126)),         # the smallest normal float32
], ids=["largest min_p", "largest top_k", "smallest temperature"])
def test_the_values_at_the_wires_edge_are_accepted(params):
    params.validate()


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("extra, param", [
    ({"min_p": 0.99999999}, "min_p"),
    ({"top_k": 2**31}, "top_k"),
    ({"temperature": 1e-50}, "temperature"),
    ({"seed": 2**64}, "seed"),  # the wire's seed is a uint64
], ids=["min_p 0.99999999", "top_k 2^31", "temperature 1e-50", "seed 2^64"])
def test_over_http_a_value_beyond_the_wire_is_a_400_naming_it(served_alone, extra, param):
    response = post(served_alone.http_url, {**CHAT, **extra})
    assert response.status_code == 400, response.text
    assert param in response.json()["error"]["message"]


def test_over_http_the_wires_edge_values_are_served_and_accepted_by_the_draft(served_duo, served_draft):
    """Each request reaches the draft, which would answer a value it could not use with a SessionError."""
    log_before = len(served_draft.log())
    for extra in ({"min_p": 0.99999994}, {"top_k": 2**31 - 1, "seed": 2**64 - 1}, {"temperature": 2**-126}):
        response = post(served_duo.http_url, {**CHAT, **extra, "max_tokens": 16})
        assert response.status_code == 200, (extra, response.text)
    draft_log = served_draft.log()[log_before:]
    assert "without the draft" not in draft_log and "ended on an error" not in draft_log, draft_log


def test_over_grpc_min_p_that_rounds_to_1_is_invalid_argument(served_alone):
    sampling = pb.SamplingParams(temperature=1.0, min_p=0.99999999)  # float32 on the client already: 1.0
    with pytest.raises(grpc.RpcError) as error:
        generate_with(served_alone.address, pb.GenerateRequest(prompt="hi", max_tokens=2, sampling=sampling))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_p" in error.value.details()


def test_over_grpc_a_top_k_of_2_to_the_31_on_the_wire_is_invalid_argument(served_alone):
    """protobuf clients refuse to encode it; a hand-made message carries it, and it parses as int32 -2^31."""
    sampling = pb.SamplingParams(temperature=1.0).SerializeToString() + b"\x10" + varint(2**31)  # field 2, top_k
    request = pb.GenerateRequest(prompt="hi", max_tokens=2).SerializeToString() + b"\x22" + varint(len(sampling)) \
        + sampling  # field 4, sampling
    with pytest.raises(grpc.RpcError) as error:
        generate_with(served_alone.address, request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_k" in error.value.details()
    assert len(generate(served_alone.address, "hello", max_tokens=2)[0]) == 2


def generate_with(address: str, request: pb.GenerateRequest | bytes) -> list[pb.GenerateResponse]:
    """Generate with a message or with raw bytes that no protobuf client would encode."""
    serialize = (lambda raw: raw) if isinstance(request, bytes) else pb.GenerateRequest.SerializeToString
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream("/duo.v1.Target/Generate", request_serializer=serialize,
                                    response_deserializer=pb.GenerateResponse.FromString)
        return list(call(request, timeout=30))


def varint(n: int) -> bytes:
    """protobuf's base-128 varint encoding of a non-negative integer."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
