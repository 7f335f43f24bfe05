"""Reading a request body: JSON on a worker thread, its shape bounded (depth, list lengths) before any per-item
validation, then validated as one of the API's bodies; and /openapi.json's description of the bodies."""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from duo.api.limits import MAX_JSON_DEPTH, BodyLimits, nesting_depth
from duo.api.requests import BadRequest, too_long

Body = TypeVar("Body", bound=BaseModel)


async def parse_body(raw: bytes, kind: type[Body], limits: BodyLimits) -> Body:
    """`raw` JSON as a `kind`, on a worker thread. A body of megabytes costs CPU under the GIL wherever it runs, and
    pydantic validates a whole list in one call that lets no other thread run: a list longer than `limits` allow is
    refused before the per-item validation, which costs the most (1.5M ids: 0.5 s, against 0.17 s to read the JSON),
    and so is JSON nested deeper than MAX_JSON_DEPTH; what is left is bounded by the body's size (max_body_bytes).
    RequestValidationError, as FastAPI raises it, when it is not a `kind`; BadRequest when it is too long or deep."""
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
    """BadRequest for a body nested too deeply or with a top-level list (or logit_bias object) longer than allowed."""
    if nesting_depth(data) > MAX_JSON_DEPTH:
        raise too_deep()
    if not isinstance(data, dict):
        return  # validation says what the body should be
    for field, value in data.items():
        bound = limits.of(field) if isinstance(value, (list, dict)) else None
        if bound is not None and len(value) > bound[0]:
            message = f"{field} holds {len(value)} items; {bound[1]}"
            if field in ("prompt", "messages", "input_extra"):
                raise too_long(message, n_prompt_tokens=len(value), n_ctx=limits.items, param=field)
            raise BadRequest(f"{message}: send fewer", param=field)


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
