"""Stream a completion from duo-target over gRPC with the generated stub, stopping at a blank line."""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", default="127.0.0.1:7071")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    # Only needed when duo-target runs with --api-key.
    key = os.environ.get("DUO_API_KEY")
    metadata = [("authorization", f"Bearer {key}")] if key else None
    with grpc.insecure_channel(args.endpoint) as channel:
        target = pb_grpc.TargetStub(channel)
        info = target.ModelInfo(pb.ModelInfoRequest(), metadata=metadata)
        n_prompt = len(target.Tokenize(pb.TokenizeRequest(prompt=args.prompt), metadata=metadata).token_ids)
        print(f"[{info.name}, context {info.context_size}, draft {info.draft or 'none'}; "
              f"prompt of {n_prompt} tokens]", file=sys.stderr)
        request = pb.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, stop=["\n\n"],
                                     sampling=pb.SamplingParams(temperature=0))
        for response in target.Generate(request, metadata=metadata):
            print(response.text, end="", flush=True)
            if response.finish_reason:
                stats = response.stats
                print(f"\n[{response.finish_reason}: {stats.generated_tokens} tokens, "
                      f"{stats.draft_tokens_accepted}/{stats.draft_tokens_verified} draft tokens accepted]",
                      file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
