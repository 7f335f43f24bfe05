#!/usr/bin/env python3
"""Extract the tokenizer metadata of a GGUF model into a small gzipped JSON file.

The output holds every ``tokenizer.*`` key of the model (vocabulary, token
types, BPE merges, special token ids, chat template, ...) together with its
GGUF value type, so that ``tests/helpers/tiny_models.py`` can write it back verbatim
into tiny random-weight test models.  It was used once to produce
``tests/data/qwen2-tokenizer.json.gz`` from Qwen2.5-Coder-0.5B-Instruct:

    python scripts/extract_tokenizer.py model.gguf tests/data/qwen2-tokenizer.json.gz

File format (JSON, gzip -9)::

    {
      "source": {"general.architecture": ..., "general.name": ...},
      "fields": [
        {"key": "tokenizer.ggml.model", "type": "STRING", "value": "gpt2"},
        {"key": "tokenizer.ggml.tokens", "type": "ARRAY", "sub_type": "STRING",
         "value": ["!", "\\"", ...]},
        ...
      ]
    }

``type``/``sub_type`` are ``gguf.GGUFValueType`` member names.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

import gguf

PREFIX = "tokenizer."


def _field_entry(field: Any) -> dict[str, Any]:
    types = list(field.types)
    entry: dict[str, Any] = {"key": field.name, "type": types[0].name}
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) != 2:
            raise ValueError(f"{field.name}: nested GGUF arrays are not supported")
        entry["sub_type"] = types[1].name
    value = field.contents()
    if isinstance(value, bytes):  # defensive: never expected for tokenizer keys
        raise ValueError(f"{field.name}: raw byte values are not supported")
    entry["value"] = value
    return entry


def extract(model: Path) -> dict[str, Any]:
    reader = gguf.GGUFReader(str(model))
    fields = [_field_entry(f) for name, f in reader.fields.items() if name.startswith(PREFIX)]
    if not fields:
        raise SystemExit(f"{model}: no {PREFIX}* metadata found")
    source = {}
    for key in ("general.architecture", "general.name"):
        if key in reader.fields:
            source[key] = reader.fields[key].contents()
    return {"source": source, "fields": fields}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="input GGUF model")
    parser.add_argument("output", type=Path, help="output .json.gz file")
    args = parser.parse_args(argv)

    data = extract(args.model)
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0 keeps the output byte-for-byte reproducible.
    with open(args.output, "wb") as raw, gzip.GzipFile(
        filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0
    ) as gz:
        gz.write(text.encode("utf-8"))
    summary = ", ".join(
        f"{f['key']}[{len(f['value'])}]" if f["type"] == "ARRAY" else f["key"] for f in data["fields"]
    )
    print(f"wrote {args.output} ({args.output.stat().st_size} bytes): {summary}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
