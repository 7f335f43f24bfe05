"""The bench's structured workload: prompts whose answer must match a JSON schema, sent with the same schema to
every mode (duo's GenerateRequest.grammar, llama-server's response_format json_schema)."""

from __future__ import annotations

import json
from typing import Any

_FUNCTIONS = {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"},
                                     "arguments": {"type": "array", "items": {"type": "string"}},
                                     "returns": {"type": "string"}, "summary": {"type": "string"}},
    "required": ["name", "arguments", "returns", "summary"], "additionalProperties": False}}
MODULE = {"type": "object", "properties": {"name": {"type": "string"}, "language": {"type": "string"},
                                           "functions": _FUNCTIONS},
          "required": ["name", "language", "functions"], "additionalProperties": False}

# A structured prompt is its text after this tag: reports tell it from the same text asked without a schema.
TAG = "[json] "
PROMPTS = [
    "Describe, as JSON, a Python module for a snake game: its functions, their arguments, return types and a "
    "one-line summary each.",
    "Describe, as JSON, a TypeScript module that parses CSV files: its functions, their arguments, return types "
    "and a one-line summary each.",
]
STRUCTURED = [TAG + prompt for prompt in PROMPTS]  # then the same prompts as free text: the workload's baseline


def split(prompt: str) -> tuple[str, dict[str, Any] | None]:
    """The text to send, and the schema its answer must match (None: free text)."""
    return (prompt[len(TAG):], MODULE) if prompt.startswith(TAG) else (prompt, None)


def schema_json(prompt: str) -> str | None:
    """The schema `prompt`'s answer must match, as JSON; None for a free-text prompt."""
    schema = split(prompt)[1]
    return json.dumps(schema) if schema is not None else None


def response_format(prompt: str) -> dict[str, Any]:
    """llama-server's (OpenAI's) response_format for `prompt`: {} for a free-text prompt."""
    schema = split(prompt)[1]
    if schema is None:
        return {}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                         "strict": True}}}
