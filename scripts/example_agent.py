"""What agents and the openai SDK send, against duo-target (duo-target --http 8000): parse() with a nested Pydantic
model, JSON mode, a tool call (whole and streamed), the tool's result sent back, tool_choice none and a named
function. Prints each answer and the drafts duo accepted for it."""

from __future__ import annotations

import argparse
import json
import os
import sys

from openai import OpenAI
from pydantic import BaseModel, ConfigDict

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris today?"}]


class Function(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: list[str]
    returns: str


class Module(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    functions: list[Function]


def drafts(answer) -> str:
    stats = (answer.model_extra or {}).get("duo_stats", {})
    return f"[drafts accepted {stats.get('draft_tokens_accepted')}/{stats.get('draft_tokens_verified')}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--max-tokens", type=int, default=300)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("DUO_API_KEY", "none"))
    model = client.models.list().data[0].id
    common = {"model": model, "max_tokens": args.max_tokens, "temperature": 0}

    parsed = client.beta.chat.completions.parse(
        messages=[{"role": "user", "content": "Describe a small Python module for a snake game: two functions."}],
        response_format=Module, **common)
    print("parse():", parsed.choices[0].message.parsed, drafts(parsed))

    json_mode = client.chat.completions.create(
        messages=[{"role": "user", "content": "List three colours as a JSON object."}],
        response_format={"type": "json_object"}, **common)
    print("json_object:", json.loads(json_mode.choices[0].message.content), drafts(json_mode))

    called = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="required", **common)
    call = called.choices[0].message.tool_calls[0]
    print("tool call:", call.function.name, call.function.arguments, called.choices[0].finish_reason, drafts(called))

    streamed = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="required", stream=True,
                                              **common)
    pieces = [delta for chunk in streamed for delta in (chunk.choices[0].delta.tool_calls or [])]
    print("streamed call:", "".join(p.function.name or "" for p in pieces),
          "".join(p.function.arguments or "" for p in pieces))

    back = ASK + [called.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny", "celsius": 21})}]
    answer = client.chat.completions.create(messages=back, tools=[WEATHER], **common)
    print("after the tool's result:", answer.choices[0].message.content, drafts(answer))

    plain = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="none", **common)
    print("tool_choice none:", plain.choices[0].message.content[:120], drafts(plain))

    named = client.chat.completions.create(
        messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **common)
    print("named:", named.choices[0].message.tool_calls[0].function.arguments, drafts(named))
    return 0


if __name__ == "__main__":
    sys.exit(main())
