"""The bounds a client's request meets before any work is done for it (README: "What a request may hold")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

# JSON nested deeper than this is refused: Python's parser and a chat template's tojson recurse once per level
# (a thousand levels is a RecursionError), and no schema, message or tool call needs more.
MAX_JSON_DEPTH = 64
# Integer fields hold what a C int holds (llama.cpp's and the wire's int32): beyond it a value means nothing,
# and turning it into a float or a protobuf field would fail after the request took its place.
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
MAX_RESPONSE_FIELDS = 64  # llama-server's response_fields: paths into one answer
MAX_RESPONSE_FIELD_LENGTH = 256
MAX_SAMPLERS = 64
MAX_TOOLS = 1024
MAX_STOP_STRINGS = 16  # more than anyone needs would make every piece slow to check


@dataclass(frozen=True)
class BodyLimits:
    """What a body's lists may hold: `items` (the context's tokens: a prompt's token ids, messages, /infill's extra
    chunks and /detokenize's ids each take one token at least, so more could never fit) and `vocab` (logit_bias
    names each vocabulary id once at most)."""

    items: int
    vocab: int

    def of(self, field: str) -> tuple[int, str] | None:
        """The most items top-level list `field` may hold, and what that bound is, where it has one (a prompt leaves
        the context room for one new token)."""
        context = (self.items, f"the context holds {self.items} tokens")
        prompt = (self.items - 1, context[1])
        return {"prompt": prompt, "messages": prompt, "input_extra": context, "tokens": context,
                "logit_bias": (self.vocab, f"the vocabulary has {self.vocab} tokens"),
                "stop": (MAX_STOP_STRINGS, "the most stop strings a request may have"),
                "response_fields": (MAX_RESPONSE_FIELDS, "the most fields an answer may be cut to"),
                "samplers": (MAX_SAMPLERS, "more than there are samplers"),
                "tools": (MAX_TOOLS, "the most tools a request may offer")}.get(field)


def nesting_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deeply `value` (parsed JSON) nests lists and objects (a scalar: 0), counted without recursion and
    without looking past `limit` + 1 levels (the caller only needs to know it is too deep)."""
    depth, level = 0, [value]
    while depth <= limit:
        containers = [node for node in level if isinstance(node, (list, dict))]
        if not containers:
            break
        depth += 1
        level = [child for node in containers for child in (node.values() if isinstance(node, dict) else node)]
    return depth
