"""The prompt forms of llama-server's /completion: text, token ids, ids and text mixed, a {"prompt_string"} object."""

from __future__ import annotations

from typing import Any

from duo.api.serving.request import BadRequest

# llama-server's names for the object form's fields (tokenize_input_subprompt).
PROMPT_STRING = "prompt_string"
MULTIMODAL_DATA = "multimodal_data"


def one_prompt(prompt: str | list[Any] | dict[str, Any]) -> dict[str, Any]:
    """CompletionRequest's prompt field for one /completion prompt, read as llama-server reads it: a list holding an
    id is one prompt (all ids: the ids as sent; ids and texts: each text tokenized where it stands), a list of none
    a batch (one prompt in it is that prompt; more: BadRequest, duo answers one prompt a request)."""
    if isinstance(prompt, dict):
        return _object_prompt(prompt)
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if any(_is_id(part) for part in prompt):
        return _sequence(prompt, "prompt")
    if len(prompt) != 1:
        raise BadRequest(f"a batch of {len(prompt)} prompts is not supported: send one request per prompt",
                         param="prompt")
    item = prompt[0]
    if isinstance(item, list) and not item:
        raise BadRequest("the prompt is empty", param="prompt")
    return one_prompt(item) if isinstance(item, (str, dict, list)) else _refused(item, "prompt[0]")


def _object_prompt(prompt: dict[str, Any]) -> dict[str, Any]:
    if MULTIMODAL_DATA in prompt:
        raise BadRequest(f"prompt.{MULTIMODAL_DATA}: duo-target reads text only (no multimodal projector)",
                         param=f"prompt.{MULTIMODAL_DATA}")
    text = prompt.get(PROMPT_STRING)
    if isinstance(text, str):
        return {"prompt": text}
    if isinstance(text, list) and text:
        return _sequence(text, f"prompt.{PROMPT_STRING}")
    raise BadRequest(f"prompt.{PROMPT_STRING} must be a string or a list of token ids and strings",
                     param=f"prompt.{PROMPT_STRING}")


def _sequence(parts: list[Any], where: str) -> dict[str, Any]:
    """One prompt of ids, or of ids and texts mixed (tokenized by duo.api.serving.prepare where they stand)."""
    for i, part in enumerate(parts):
        if not (_is_id(part) or isinstance(part, str)):
            _refused(part, f"{where}[{i}]")
    return {"prompt_tokens": list(parts)}


def _is_id(part: Any) -> bool:
    return isinstance(part, int) and not isinstance(part, bool)


def _refused(part: Any, where: str) -> dict[str, Any]:
    raise BadRequest(f"{where} must be a string, a list of token ids and strings, or a {{\"{PROMPT_STRING}\": ...}} "
                     f"object, got {type(part).__name__}", param=where)
