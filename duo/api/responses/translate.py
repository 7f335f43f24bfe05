"""A Responses API request as the chat request duo already serves: input items to chat messages, its tools to chat
tools (duo.api.responses.tools), text.format to response_format, max_output_tokens to max_completion_tokens."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from duo.api.openai.bodies import ChatBody
from duo.api.serving.request import BadRequest, too_long
from duo.api.responses.body import InputItem, NamedTool, Part, ResponsesBody
from duo.api.responses.tools import ResponsesTools, chat_call, flat_name

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# Items the model wrote that a chat template does not take back: its reasoning (templates drop the reasoning of
# earlier turns, and OpenAI's encrypted reasoning means nothing to another model).
DROPPED_ITEMS = ("reasoning",)
CALL_OUTPUTS = ("function_call_output", "custom_tool_call_output")
# The chat fields a Responses body carries under the same name.
SAME_FIELDS = ("model", "temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "min_p", "stop",
               "presence_penalty", "frequency_penalty", "timings_per_token", "return_progress")


def input_messages(body: ResponsesBody) -> list[dict[str, Any]]:
    """The body's input as chat messages (instructions not included); BadRequest naming the item that duo cannot
    render. How many items it may hold was bounded before validation (duo.api.serving.read)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}] if body.input else []
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        if item.type == "message":
            messages.append(_message(item, i))
        elif item.type in ("function_call", "custom_tool_call"):
            _add_call(messages, item, i)
        elif item.type in CALL_OUTPUTS:
            _need(item.call_id, f"input[{i}].call_id", "the call it answers")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"input[{i}].output")})
        elif item.type not in DROPPED_ITEMS:
            raise BadRequest(f"input[{i}].type {item.type!r} is not supported by duo-target; it takes message, "
                             "function_call, custom_tool_call, their outputs and reasoning items",
                             param=f"input[{i}].type")
    return messages


def check_fits(conversation: list[dict[str, Any]], n_ctx: int) -> None:
    """BadRequest where the conversation (the held one and this input) has more messages than the context holds
    tokens (each takes one at least), before the chat body validates every one of them."""
    if len(conversation) >= n_ctx:
        raise too_long(f"the conversation holds {len(conversation)} messages with previous_response_id's, each a "
                       "token at least", n_prompt_tokens=len(conversation), n_ctx=n_ctx, param="input")


def _message(item: InputItem, i: int) -> dict[str, Any]:
    if item.role not in ROLES:
        raise BadRequest(f"input[{i}].role must be one of {', '.join(ROLES)}, got {item.role!r}",
                         param=f"input[{i}].role")
    return {"role": item.role, "content": _text(item.content, f"input[{i}].content")}


def _add_call(messages: list[dict[str, Any]], item: InputItem, i: int) -> None:
    """A call the model made, on the assistant message before it (where it wrote text first) or on a new one: chat
    templates take an answer's calls on its message. It is written as the model wrote it: a namespace's function
    under its flat name, a custom tool's input as the function's one argument (duo.api.responses.tools)."""
    _need(item.call_id, f"input[{i}].call_id", "the id its output answers")
    _need(item.name, f"input[{i}].name", "the tool called")
    call = chat_call(item.model_dump())
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last["tool_calls"] = [*last.get("tool_calls", []), call]  # a new list: a held message's stays as held
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _need(value: str | None, param: str, what: str) -> None:
    if not value:
        raise BadRequest(f"{param} is missing: it names {what}", param=param)


def _text(content: str | list[Part] | None, param: str) -> str:
    """A content's text; only text parts can be rendered by a chat template."""
    if not isinstance(content, list):
        return content or ""
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise BadRequest(f"{param}[{j}]: only text parts are supported, got a {part.type!r} part",
                             param=f"{param}[{j}].type")
    return "".join(part.text or "" for part in content)


def chat_body(body: ResponsesBody, messages: list[dict[str, Any]], tools: ResponsesTools) -> ChatBody:
    """The chat request that answers `body`, its conversation being `messages` (held history and this input), its
    instructions first, its `tools` offered as chat's."""
    if not messages:
        raise BadRequest("input must not be empty: send the user's message (or the items that continue "
                         "previous_response_id)", param="input")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {name: getattr(body, name) for name in SAME_FIELDS if getattr(body, name) is not None}
    fields.update(messages=system + messages, stream=bool(body.stream), max_completion_tokens=body.max_output_tokens)
    if tools.chat:
        fields["tools"] = tools.chat
    if body.tool_choice is not None:
        fields["tool_choice"] = {"type": "function", "function": {
            "name": flat_name(body.tool_choice.namespace, body.tool_choice.name or "")}} \
            if isinstance(body.tool_choice, NamedTool) else body.tool_choice
    text_format = body.text.format if body.text else None
    if text_format is not None and text_format.type != "text":
        fields["response_format"] = {"type": text_format.type} if text_format.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": text_format.name, "schema": text_format.schema_,
                                                   "strict": text_format.strict}}
    try:
        chat = ChatBody.model_validate(fields)
    except ValidationError as error:  # what the chat body checks beyond this one (its bounds on sampling fields)
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise BadRequest(f"{where}: {first.get('msg', 'invalid value')}", param=where) from None
    tools.constrain(chat.tools or [])
    return chat

