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
MAX_INCLUDE = 64  # the Responses API's include: OpenAI knows a handful of values
# Objects pydantic reads key by key (700k keys: 0.3 s with no other thread running): a JSON schema has a few dozen
# keywords at its top, a template a few variables, OpenAI's metadata 16 pairs.
MAX_OBJECT_KEYS = 1024
OBJECTS = ("json_schema", "response_format.schema", "response_format.json_schema.schema", "text.format.schema",
           "tools[*].parameters", "tools[*].function.parameters", "tools[*].input_schema", "chat_template_kwargs",
           "metadata", "reasoning", "output_config.format.schema", "output_format.schema",
           "tools[*].tools[*].parameters")
# Names and ids, in characters. A function's name is rendered by the chat template (OpenAI allows 64 characters);
# a call's id seldom is (OpenAI's are about 30 characters, Anthropic's about 30, Mistral's template takes 9), yet
# both are checked for control tokens, copied into every later turn and held for previous_response_id: a
# megabyte one cost seconds and memory for nothing. A model's name may be a file's path (PATH_MAX).
MAX_NAME_LENGTH = 256
MAX_ID_LENGTH = 256
MAX_MODEL_NAME_LENGTH = 4096

# The lists a prompt is made of. Each item takes a token of the prompt at least (a message or an input item the
# markup of its role, a content part, block or tool call its text), so a body with more of them, in one list or all
# together, could never fit: they are refused before validation, which costs the most per item (pydantic: 2-4 us a
# part, with no other thread running). Not exact for parts, which are joined: an empty part takes no token, and a
# text cut into parts of one character each may take fewer tokens than parts; no client sends either by the
# thousand. `[*]`: each item of a list.
PROMPT_LISTS = (
    "prompt", "messages",                       # /completion's ids; chat's, /apply-template's and Messages' turns
    "messages[*].content",                      # chat's content parts, Messages' content blocks
    "messages[*].tool_calls",                   # chat: an assistant's calls
    "messages[*].content[*].content",           # Messages: a tool_result's blocks
    "system",                                   # Messages: the system blocks
    "input", "input[*].content", "input[*].output",  # Responses: the items, their content parts, a call's output
)
# The strings nobody needs long: names (rendered) and ids (mostly not rendered), with what each names.
NAMES = {"messages[*].name": "a participant's name", "messages[*].tool_calls[*].function.name": "a function's name",
         "messages[*].content[*].name": "a tool's name", "tools[*].name": "a tool's name",
         "tools[*].function.name": "a function's name", "tool_choice.name": "a tool's name",
         "tool_choice.function.name": "a function's name", "input[*].name": "a function's name",
         "tools[*].tools[*].name": "a tool's name", "tool_choice.namespace": "a namespace's name",
         "input[*].namespace": "a namespace's name"}
IDS = {"messages[*].tool_call_id": "a call's id", "messages[*].tool_calls[*].id": "a call's id",
       "messages[*].content[*].id": "a call's id", "messages[*].content[*].tool_use_id": "a call's id",
       "input[*].call_id": "a call's id", "previous_response_id": "a response's id", "user": "a user's id"}
# Lists bounded by the context alone: /infill's extra chunks (those that do not fit are left out) and /detokenize's ids.
CONTEXT_LISTS = ("input_extra", "tokens")
# Lists whose bound is the same whatever the model: (the most items they hold, what that bound is).
FIXED_LISTS = {"stop": (MAX_STOP_STRINGS, "the most stop strings a request may have"),
               "stop_sequences": (MAX_STOP_STRINGS, "the most stop strings a request may have"),
               "response_fields": (MAX_RESPONSE_FIELDS, "the most fields an answer may be cut to"),
               "samplers": (MAX_SAMPLERS, "more than there are samplers"),
               "tools": (MAX_TOOLS, "the most tools a request may offer"),
               "tools[*].tools": (MAX_TOOLS, "the most tools a request may offer"),  # a Responses namespace's
               "include": (MAX_INCLUDE, "more than there are values to include"),
               **{path: (MAX_OBJECT_KEYS, "the most keys an object of settings or a schema's top may have")
                  for path in OBJECTS}}
# Strings: (the most characters they hold, what that bound is).
STRINGS = {"model": (MAX_MODEL_NAME_LENGTH, f"a model's name may hold {MAX_MODEL_NAME_LENGTH}"),
           **{path: (MAX_NAME_LENGTH, f"{what} may hold {MAX_NAME_LENGTH}") for path, what in NAMES.items()},
           **{path: (MAX_ID_LENGTH, f"{what} may hold {MAX_ID_LENGTH}") for path, what in IDS.items()}}
# Every path BodyLimits bounds.
BOUNDED_PATHS = (*PROMPT_LISTS, *CONTEXT_LISTS, "logit_bias", *FIXED_LISTS, *STRINGS)


@dataclass(frozen=True)
class Bound:
    """The most a list (items) or, for `text`, a string (characters) at one path of a body may hold, and what that
    bound is; `prompt`: a list the prompt is made of, counted with the others and refused as a prompt too long."""

    most: int
    why: str
    prompt: bool = False
    text: bool = False


@dataclass(frozen=True)
class BodyLimits:
    """What a body's lists may hold: `items` (the context's tokens: a prompt's token ids, messages, content parts,
    /infill's extra chunks and /detokenize's ids each take one token at least, so more could never fit) and `vocab`
    (logit_bias names each vocabulary id once at most)."""

    items: int
    vocab: int

    def of(self, path: str) -> Bound | None:
        """The bound of the list or string at `path` (a body's path, `[*]` for each item of a list), where it has
        one; a prompt's lists leave the context room for one new token, together as alone."""
        if path in PROMPT_LISTS:
            return Bound(self.items - 1, f"the context holds {self.items} tokens", prompt=True)
        if path in CONTEXT_LISTS:
            return Bound(self.items, f"the context holds {self.items} tokens")
        if path == "logit_bias":
            return Bound(self.vocab, f"the vocabulary has {self.vocab} tokens")
        if path in FIXED_LISTS:
            return Bound(*FIXED_LISTS[path])
        return Bound(*STRINGS[path], text=True) if path in STRINGS else None


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
