"""`duo generate`: stream a completion from duo-target over gRPC and print it (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator

import grpc
from google.protobuf.json_format import MessageToDict

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.net.options import grpc_channel_options
from duo.net.tls import channel_credentials


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", default="127.0.0.1:7071", help="duo-target's HOST:PORT")
    parser.add_argument("--prompt", required=True, help="the prompt (raw text unless --chat)")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message, "
                        "rendered with the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end the completion where this text first appears (not printed); repeatable")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, token_ids, finish_reason, stats) at the end")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="the key duo-target was started with (default: $DUO_API_KEY)")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="connect over TLS, trusting the CA in this PEM file (duo-target --tls-cert)")
    parser.add_argument("--connect-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="give up when duo-target does not answer within this long")


def request_from(args: argparse.Namespace) -> pb.GenerateRequest:
    if args.max_tokens < 0:
        raise ValueError("--max-tokens must be >= 0")
    sampling = pb.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                 min_p=args.min_p)
    if args.seed is not None:
        sampling.seed = args.seed
    request = pb.GenerateRequest(max_tokens=args.max_tokens, sampling=sampling, stop=args.stop)
    if args.chat:
        request.messages.append(pb.ChatMessage(role="user", content=args.prompt))
    else:
        request.prompt = args.prompt
    return request


def stream(endpoint: str, request: pb.GenerateRequest, *, api_key: str | None = None,
           tls_ca: str | None = None, connect_timeout: float = 10.0) -> Iterator[pb.GenerateResponse]:
    """Stream a Generate call; ConnectionError when nothing answers at `endpoint` in time."""
    options = grpc_channel_options()
    channel = (grpc.secure_channel(endpoint, channel_credentials(tls_ca), options=options) if tls_ca
               else grpc.insecure_channel(endpoint, options=options))
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            raise ConnectionError(f"cannot reach duo-target at {endpoint} within {connect_timeout:g} s: "
                                  "is it running, and is that its --listen address?") from None
        yield from pb_grpc.TargetStub(channel).Generate(request, metadata=metadata, timeout=3600)


def run_generate(args: argparse.Namespace) -> int:
    try:
        request = request_from(args)
        text, token_ids, last = [], [], pb.GenerateResponse()
        api_key = args.api_key or os.environ.get("DUO_API_KEY") or None
        for response in stream(args.endpoint, request, api_key=api_key, tls_ca=args.tls_ca,
                               connect_timeout=args.connect_timeout):
            text.append(response.text)
            token_ids.extend(response.token_ids)
            last = response
            if not args.json:
                print(response.text, end="", flush=True)
    except grpc.RpcError as error:
        print(f"\nduo generate: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except ConnectionError as error:
        print(f"duo generate: {error}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"duo generate: {error}", file=sys.stderr)
        return 2
    stats = MessageToDict(last.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if args.json:
        print(json.dumps({"text": "".join(text), "token_ids": token_ids, "finish_reason": last.finish_reason,
                          "stats": stats}))
    else:
        print()
        print(format_stats(last.stats), file=sys.stderr)
    return 0


def format_stats(stats: pb.Stats) -> str:
    acceptance = (stats.draft_tokens_accepted / stats.draft_tokens_verified) if stats.draft_tokens_verified else 0.0
    per_step = stats.generated_tokens / stats.verify_steps if stats.verify_steps else 0.0
    return (f"[{stats.generated_tokens} tokens, {stats.tokens_per_second:.1f} tok/s, prompt {stats.prompt_tokens} "
            f"tokens ({stats.cached_prompt_tokens} cached), "
            f"first token {stats.time_to_first_token_s * 1000:.0f} ms, {stats.verify_steps} verify steps "
            f"({per_step:.2f} tokens/step), draft: {stats.draft_tokens_received} received, "
            f"{stats.draft_tokens_accepted}/{stats.draft_tokens_verified} accepted ({acceptance:.0%})"
            + (f"; speculation {stats.speculation}" if stats.speculation else "") + "]")
