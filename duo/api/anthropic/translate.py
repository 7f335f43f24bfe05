"""A Messages API request as the chat request duo already serves: system and content blocks to chat messages,
tool_use and tool_result blocks to tool calls and tool messages, tools and tool_choice to their chat forms."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from duo.api.openai.bodies import ChatBody
from duo.api.anthropic.body import Block, CountTokensBody, MessageBody, TextBlock, ToolChoiceBody, ToolDefinition
from duo.api.serving.request import BadRequest

# Blocks of earlier answers that a chat template does not take back: reasoning redacted (encrypted for Anthropic's
# models, it means nothing to another), as llama-server drops it. A thinking block's text is the answer's
# reasoning_content, as llama-server passes it to the template (which renders it where it keeps reasoning).
DROPPED_BLOCKS = ("redacted_thinking",)
# Client tools; any other `type` names one of Anthropic's server tools (web_search_20250305, bash_20250124, ...).
CLIENT_TOOL_TYPES = (None, "custom")
# Claude Code's first system block: billing metadata, not an instruction, whose cch= stamp changes on every request
# (llama.cpp PR 21793), so that no prompt would share its prefix with the one before: the stamp is left out.
BILLING_HEADER = "x-anthropic-billing-header:"
BILLING_STAMP = re.compile(r"\bcch=[^;]*;")
# Anthropic's tool ids start so; duo's own call ids (duo.api.tools) go back to the template without it.
ANTHROPIC_ID = "toolu_"
# Text blocks are passages: joined by a line break, so that one does not run into the next.
BLOCK_SEPARATOR = "\n"


def chat_body(body: CountTokensBody) -> ChatBody:
    """The chat request that renders `body`'s prompt (and generates its answer, for a MessagesBody); BadRequest
    naming the block or tool that duo cannot serve."""
    body.check_served()
    fields: dict[str, Any] = {"messages": system_messages(body.system) + conversation(body.messages),
                              **body.generation_fields()}
    if body.tools:
        fields["tools"] = [chat_tool(tool, i) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields.update(chat_tool_choice(body.tool_choice))
    if body.thinking is not None:
        # Templates that reason (Qwen3, DeepSeek) read enable_thinking; the others ignore it.
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    try:
        return ChatBody.model_validate(fields)
    except ValidationError as error:  # the body's own checks passed: a value that chat bounds more narrowly
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise BadRequest(f"{field}: {first['msg']}", param=field) from None


def system_messages(system: str | list[Block] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    texts = [_text(block, f"system[{i}]") for i, block in enumerate(system)]
    texts = [BILLING_STAMP.sub("", text, count=1) if text.startswith(BILLING_HEADER) else text for text in texts]
    return [{"role": "system", "content": BLOCK_SEPARATOR.join(texts)}] if texts else []


def conversation(messages: list[MessageBody]) -> list[dict[str, Any]]:
    return [chat for i, message in enumerate(messages) for chat in chat_messages(message, i)]


def chat_messages(message: MessageBody, index: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: an assistant's text and calls as one message; a user's tool results
    as tool messages, then its text (Anthropic puts a turn's results before its text); a system message's text where
    it stands, as llama-server passes it to the template."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "system":
        texts = [_text(block, f"messages[{index}].content[{j}]", "system") for j, block in enumerate(message.content)]
        return [{"role": "system", "content": BLOCK_SEPARATOR.join(texts)}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for j, block in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if block.type == "text":
            texts.append(_text(block, where))
        elif block.type == "thinking" and message.role == "assistant":
            reasoning += block.thinking or ""  # joined as llama-server joins them
        elif block.type == "tool_use" and message.role == "assistant":
            calls.append(_call(block, where))
        elif block.type == "tool_result" and message.role == "user":
            results.append(_result(block, where))
        elif block.type not in DROPPED_BLOCKS and not (block.type == "thinking" and message.role == "user"):
            raise _unsupported(block.type, where, message.role)
    if message.role == "assistant":
        return [_answer(texts, calls, reasoning)] if texts or calls or reasoning else []
    return results + ([{"role": "user", "content": BLOCK_SEPARATOR.join(texts)}] if texts else [])


def _answer(texts: list[str], calls: list[dict[str, Any]], reasoning: str) -> dict[str, Any]:
    answer: dict[str, Any] = {"role": "assistant", "content": BLOCK_SEPARATOR.join(texts)}
    if calls:
        answer["tool_calls"] = calls
    if reasoning:
        answer["reasoning_content"] = reasoning
    return answer


def chat_tool(tool: ToolDefinition, index: int) -> dict[str, Any]:
    if tool.type not in CLIENT_TOOL_TYPES:
        raise BadRequest(f"tools[{index}] is Anthropic's server tool {tool.type!r}, which duo-target cannot run; send "
                         "client tools ({name, description, input_schema}) only", param=f"tools[{index}].type")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def chat_tool_choice(choice: ToolChoiceBody) -> dict[str, Any]:
    """tool_choice and parallel_tool_calls as chat takes them: any is required, tool a named function."""
    fields: dict[str, Any] = {}
    if choice.type == "tool":
        if not choice.name:
            raise BadRequest("tool_choice of type tool needs name: the tool the model must call",
                             param="tool_choice.name")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def anthropic_id(call_id: str) -> str:
    """A call's id as Anthropic writes it (toolu_...); template_id gives the call's own id back."""
    return ANTHROPIC_ID + call_id.removeprefix("call_")


def template_id(tool_use_id: str) -> str:
    """The id a chat template is given for a tool_use id (Mistral's template takes only its own 9-character ids)."""
    return tool_use_id.removeprefix(ANTHROPIC_ID)


def _call(block: Block, where: str) -> dict[str, Any]:
    if not block.id or not block.name:
        raise BadRequest(f"{where}: a tool_use block needs its id and name", param=where)
    arguments = block.input if block.input is not None else {}
    return {"id": template_id(block.id), "type": "function",
            "function": {"name": block.name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _result(block: Block, where: str) -> dict[str, Any]:
    if not block.tool_use_id:
        raise BadRequest(f"{where}: a tool_result block needs tool_use_id: the call it answers", param=where)
    content = block.content
    if isinstance(content, list):
        content = BLOCK_SEPARATOR.join(_text(part, f"{where}.content[{k}]") for k, part in enumerate(content))
    return {"role": "tool", "tool_call_id": template_id(block.tool_use_id), "content": content or ""}


def _text(block: TextBlock, where: str, role: str = "") -> str:
    if block.type != "text":
        raise _unsupported(block.type, where, role)
    return block.text or ""


def _unsupported(kind: str, where: str, role: str) -> BadRequest:
    if kind in ("image", "document"):
        return BadRequest(f"{where} is a block of type {kind!r}: duo-target serves a text model, which reads no "
                          "images or documents; send text blocks", param=where)
    if kind in ("tool_use", "tool_result") and role:
        belongs = "an assistant" if kind == "tool_use" else "a user"
        return BadRequest(f"{where}: a {kind} block belongs in {belongs} message, not in the {role}'s", param=where)
    return BadRequest(f"{where} is a {kind!r} block, which duo-target does not support; it takes text, tool_use and "
                      "tool_result blocks", param=where)
