"""A chat template rendered as llama-server renders it: Jinja in a sandbox with llama.cpp's engine's tolerance, and the
variables llama-server gives every template (today's date, strftime_now, the launch line's template variables)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _IgnoreGenerationTags(jinja2.ext.Extension):
    """HuggingFace's `{% generation %}` block (it marks the assistant's tokens for training): its body rendered as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _absent(value: Any) -> bool:
    return value is None or isinstance(value, jinja2.Undefined)


class _LlamaCppJinja(ImmutableSandboxedEnvironment):
    """Jinja where `+` joining a string and a none or undefined value reads that value as "", as llama.cpp's engine
    (common/jinja) does: firefunction-v2's template adds `functions`, which llama-server leaves undefined, to its system
    prompt; Jinja proper raises there."""

    intercepted_binops = frozenset({"+"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and ((_absent(left) and isinstance(right, str)) or (isinstance(left, str) and _absent(right))):
            return ("" if _absent(left) else left) + ("" if _absent(right) else right)
        return super().call_binop(context, operator, left, right)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """tojson as HuggingFace's chat templates expect it: not HTML-escaped, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ValueError(message)


# The names ChatTemplate.render gives values of its own (functions, function_call and tool_choice too, as
# llama-cpp-python's formatter before it did): the variables of a request or the launch line may not set them.
RENDERER_NAMES = frozenset({"messages", "tools", "functions", "function_call", "tool_choice", "eos_token", "bos_token",
                            "raise_exception", "add_generation_prompt", "strftime_now"})


def reserved_names(variables: Mapping[str, Any]) -> list[str]:
    """The names among `variables` that the renderer gives itself (RENDERER_NAMES), sorted: what may not be set."""
    return sorted(RENDERER_NAMES & set(variables))


def _server_variables(now: datetime) -> dict[str, Any]:
    """What llama-server gives every template before the launch line's and the request's variables: today's date in
    its formats (common/chat.cpp's extra context: Llama 3.x's `date_string`, 28 Nov 2026; firefunction-v2's
    `datetime`, Nov 28 2026), and enable_thinking true (its --reasoning auto, for a template that can think; one that
    cannot reads the same either way)."""
    return {"datetime": now.strftime("%b %d %Y"), "date_string": now.strftime("%d %b %Y"), "enable_thinking": True}


class ChatTemplate:
    """One Jinja chat template, compiled once, with the model's BOS and EOS texts and the launch line's variables
    (`defaults`: --reasoning's enable_thinking, --chat-template-kwargs), which a request's variables override."""

    def __init__(self, source: str, *, bos_token: str, eos_token: str, defaults: Mapping[str, Any] | None = None,
                 clock: Callable[[], datetime] = datetime.now) -> None:
        # An item or attribute of an undefined value is undefined, as llama.cpp's engine reads it: Qwen's
        # `messages[0]['role']` with no message at all (llama-server answers an empty chat; Jinja proper raises).
        environment = _LlamaCppJinja(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined,
                                     extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols])
        environment.filters["tojson"] = _tojson
        self.source = source
        self._template = environment.from_string(source)
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self._defaults = dict(defaults or {})
        self._clock = clock

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (),
               variables: Mapping[str, Any] | None = None, *, add_generation_prompt: bool = True) -> str:
        """The chat as the template writes it. Raises jinja2.TemplateError for a template that fails, ValueError for
        one that refuses the messages (its raise_exception)."""
        return self._template.render(
            _server_variables(self._clock()) | self._defaults | dict(variables or {}),
            messages=[dict(message) for message in messages], tools=list(tools) or None,
            add_generation_prompt=add_generation_prompt, raise_exception=_raise_exception,
            strftime_now=lambda format_: self._clock().strftime(format_), **self._tokens)
