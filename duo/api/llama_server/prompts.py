"""The prompt forms of llama-server's /completion: text, token ids, ids and text mixed, a {"prompt_string"} object."""

from __future__ import annotations

from typing import Any

from duo.api.serving.request import BadRequest

# llama-server's names for the object form's fields (tokenize_input_subprompt).
PROMPT_STRING = "prompt_string"
MULTIMODAL_DATA = "multimodal_data"


def prompts_of(prompt: str | list[Any] | dict[str, Any]) -> list[dict[str, Any]]:
    """CompletionRequest's prompt fields for each prompt of a /completion body, read as llama-server reads them
    (tokenize_input_prompts): a list holding an id is one prompt (all ids: the ids as sent; ids and texts: each text
    tokenized where it stands), a list of none a batch, each of its items a prompt of its own."""
    if isinstance(prompt, list) and not any(_is_id(part) for part in prompt):
        if not prompt:
            raise BadRequest("the prompt is empty", param="prompt")
        return [_subprompt(item, f"prompt[{i}]") for i, item in enumerate(prompt)]
    return [_subprompt(prompt, "prompt")]


def one_prompt(prompt: str | list[Any] | dict[str, Any]) -> dict[str, Any]:
    """The prompt fields of a body that must hold one prompt (a batch of one is that prompt)."""
    prompts = prompts_of(prompt)
    if len(prompts) != 1:
        raise BadRequest(f"a batch of {len(prompts)} prompts is not supported here: send one prompt", param="prompt")
    return prompts[0]


def _subprompt(prompt: Any, where: str) -> dict[str, Any]:
    """One prompt: text, a list of ids (texts among them), or the object form."""
    if isinstance(prompt, dict):
        return _object_prompt(prompt, where)
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and (not prompt or any(_is_id(part) for part in prompt)):
        return _sequence(prompt, where)
    return _refused(prompt, where)


def _object_prompt(prompt: dict[str, Any], where: str) -> dict[str, Any]:
    if MULTIMODAL_DATA in prompt:
        raise BadRequest(f"{where}.{MULTIMODAL_DATA}: duo-target reads text only (no multimodal projector)",
                         param=f"{where}.{MULTIMODAL_DATA}")
    text = prompt.get(PROMPT_STRING)
    if isinstance(text, str):
        return {"prompt": text}
    if isinstance(text, list) and text:
        return _sequence(text, f"{where}.{PROMPT_STRING}")
    raise BadRequest(f"{where}.{PROMPT_STRING} must be a string or a list of token ids and strings",
                     param=f"{where}.{PROMPT_STRING}")


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
