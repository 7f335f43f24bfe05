"""Reading a request body: JSON on a worker thread, its shape bounded (depth, lists at every depth, names and ids)
before any per-item validation, then validated as one of the API's bodies; and /openapi.json's description of the
bodies."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from duo.api.serving.limits import BOUNDED_PATHS, MAX_JSON_DEPTH, BodyLimits, Bound, nesting_depth
from duo.api.serving.request import BadRequest, too_long

Body = TypeVar("Body", bound=BaseModel)


async def parse_body(raw: bytes, kind: type[Body], limits: BodyLimits) -> Body:
    """`raw` JSON as a `kind`, on a worker thread. A body of megabytes costs CPU under the GIL wherever it runs, and
    pydantic validates a whole list in one call that lets no other thread run (135,000 Responses input items: 0.4 s,
    250,000 content parts or blocks: 0.7-0.9 s, against 0.1 s to read the JSON): a list longer than `limits` allow,
    at any depth the protocols have, more prompt items together than the context holds, an over-long name or id, or
    JSON nested deeper than MAX_JSON_DEPTH is refused before that validation (check_shape); what is left is bounded
    by the body's size (max_body_bytes). RequestValidationError, as FastAPI raises it, when it is not a `kind`;
    BadRequest when it is too long or deep."""
    return await asyncio.to_thread(_validated, raw, kind, limits)


def _validated(raw: bytes, kind: type[Body], limits: BodyLimits) -> Body:
    # Python's JSON parser, as FastAPI's: it keeps a lone surrogate, which the prompt's check then names.
    try:
        data = json.loads(raw) if raw.strip() else None
    except ValueError as error:
        detail = error.msg if isinstance(error, json.JSONDecodeError) else str(error)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
                                       "ctx": {"error": detail}}]) from None
    except RecursionError:  # the parser recurses once per level: a thousand levels exhaust it
        raise too_deep() from None
    check_shape(data, limits)
    try:
        return kind.model_validate(data)
    except ValidationError as error:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in error.errors()]) from None


def check_shape(data: Any, limits: BodyLimits) -> None:
    """BadRequest for a body nested too deeply, or with a list (or logit_bias object) or a name or id longer than
    `limits` allow at any of BOUNDED_PATHS, or with more prompt items together than the context holds. The body is
    walked along those paths alone, each list's length checked before its items are visited: the walk stops at the
    first excess, and visits no more than the bounds let through (it goes no deeper than the paths, so it goes
    first: the depth is counted over the whole body)."""
    if isinstance(data, dict):  # else validation says what the body should be
        ShapeCheck(limits).walk(data, SHAPE)
    if nesting_depth(data) > MAX_JSON_DEPTH:
        raise too_deep()


@dataclass
class Step:
    """A step of the bounded paths: the pattern of the path that ends here, and the steps below it ("*": each item
    of the list here)."""

    pattern: str
    below: dict[str, Step] = field(default_factory=dict)


def path_tree(paths: Iterable[str]) -> dict[str, Step]:
    """`paths` ("messages[*].content") as a tree of steps (messages, *, content)."""
    tree: dict[str, Step] = {}
    for path in paths:
        below, pattern = tree, ""
        for name in re.split(r"[.\[\]]+", path):
            if name:
                pattern = pattern + (f"[{name}]" if name == "*" else f".{name}" if pattern else name)
                below = below.setdefault(name, Step(pattern)).below
    return tree


SHAPE = path_tree(BOUNDED_PATHS)
Where = tuple[Any, ...]  # a path as (the path above, its last key or index): spelled out only for an error


def spelled(where: Where) -> str:
    """`where` as the errors name it: input[3].content."""
    steps: list[Any] = []
    while where:
        where, last = where
        steps.append(last)
    return "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in reversed(steps)).lstrip(".")


class ShapeCheck:
    """One body's walk along the bounded paths, with the prompt's items counted so far (duo.api.serving.limits.PROMPT_LISTS:
    each takes a token at least, so together they must fit the context as each must alone). A path is spelled out
    only for an error: the walk visits every message and part that the bounds let through, at a few lookups each."""

    def __init__(self, limits: BodyLimits) -> None:
        self.limits = limits
        self.bounds = {pattern: limits.of(pattern) for pattern in BOUNDED_PATHS}
        self.prompt_items = 0

    def walk(self, value: Any, below: dict[str, Step], where: Where = ()) -> None:
        """Check what `value` (at `where`) holds at the steps `below` it."""
        for name, step in below.items():
            if name != "*":
                if isinstance(value, dict) and name in value:
                    self.check(value[name], step, (where, name))
                continue
            for i, item in enumerate(value if isinstance(value, list) else ()):
                if isinstance(item, dict):  # each item's fields looked up here: a call less per item
                    for field_name, field_step in step.below.items():
                        if field_name in item:
                            self.check(item[field_name], field_step, ((where, i), field_name))

    def check(self, value: Any, step: Step, where: Where) -> None:
        """BadRequest where `value` holds more than its step's bound (a string's bound only bounds a string there,
        a list's only a list or object: a stop string or a content's text is bounded otherwise); then its steps."""
        bound = self.bounds.get(step.pattern)
        if bound is not None:
            if bound.text:
                if isinstance(value, str) and len(value) > bound.most:
                    raise BadRequest(f"{spelled(where)} holds {len(value)} characters; {bound.why}: send a shorter "
                                     "one", param=spelled(where))
            elif isinstance(value, (list, dict)):
                self._count(len(value), bound, where)
        if step.below and isinstance(value, (list, dict)):
            self.walk(value, step.below, where)

    def _count(self, size: int, bound: Bound, where: Where) -> None:
        if size > bound.most:
            message = f"{spelled(where)} holds {size} items; {bound.why}"
            if bound.prompt:
                raise too_long(message, n_prompt_tokens=size, n_ctx=self.limits.items, param=spelled(where))
            raise BadRequest(f"{message}: send fewer", param=spelled(where))
        if bound.prompt:
            self.prompt_items += size
            if self.prompt_items > bound.most:
                raise too_long(f"the prompt's messages, items, parts and blocks number {self.prompt_items} with "
                               f"{spelled(where)}'s, each a token at least; {bound.why}",
                               n_prompt_tokens=self.prompt_items, n_ctx=self.limits.items, param=spelled(where))


def too_deep() -> BadRequest:
    return BadRequest(f"the request body nests lists and objects more than {MAX_JSON_DEPTH} levels deep",
                      code="nested_too_deeply")


def document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Describe each POST path's JSON body in /openapi.json, as FastAPI would had it parsed the body itself."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, kind in bodies.items():
                body = kind.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[kind.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{kind.__name__}"}}}}
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
