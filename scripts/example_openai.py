"""Stream a chat completion from duo-target with the official `openai` package (duo-target --http 8000)."""

from __future__ import annotations

import argparse
import os
import sys

from openai import OpenAI


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--prompt", default="Write a Python function that reverses a string.")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    # Any key works unless duo-target was started with --api-key (or $DUO_API_KEY).
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("DUO_API_KEY", "none"))
    model = client.models.list().data[0].id  # duo-target serves one model
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
