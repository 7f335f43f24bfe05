"""The call formats of chat template families, and which one a template asks for (as llama.cpp's chat layer tells)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from duo.api.tools.messages import ToolError

# How a call names its function: inside a JSON object ("json": {"name": ..., "arguments": {...}}), in a header
# before its JSON arguments ("header": <function=name>{...}), or in XML with one element per argument ("xml").
Naming = Literal["json", "header", "xml", "generic"]


@dataclass(frozen=True)
class CallFormat:
    """How a family of chat templates asks the model to write its calls. A call reads

        section  ( call_open  [header_prefix NAME header_end | JSON object naming it]  ARGUMENTS  call_close )+  section_end

    where each part but the arguments may be empty; `listed` JSON formats hold their calls in one JSON array."""

    name: str
    detect: tuple[str, ...]       # the template holds all of these: it asks for this format
    naming: Naming
    call_open: str = ""           # what opens each call
    call_close: str = ""          # what closes each call ("": the next call, or the end, does)
    section: str = ""             # what opens the calls together (Mistral's [TOOL_CALLS])
    section_end: str = ""         # what closes them together
    header_prefix: str = ""       # header: text before the name ("function<｜tool▁sep｜>", "functions.")
    header_end: str = ""          # header: what ends the name (and anything after it up to the arguments)
    name_key: str = "name"        # json: the key of the function's name
    arguments: str = "arguments"  # json: the key of its arguments
    listed: bool = False          # json: the calls are one JSON array
    at_start: bool = False        # the answer is calls or no call (Llama 3.x, the generic format: a JSON object)
    think: tuple[str, str] = ("<think>", "</think>")  # what opens and closes the model's reasoning
    dropped: tuple[str, ...] = ()  # the template's markup around content, which is not content (GPT-OSS' channels)
    wrappings: tuple[str, ...] = ()  # other openings the family's parser reads a call after (Hermes': HERMES_WRAPPINGS)

    @property
    def openers(self) -> tuple[str, ...]:
        """What may open calls: the format's own opening first, then the other wrappings its parser reads."""
        return (self.section or self.call_open, *self.wrappings)

    @property
    def markers(self) -> tuple[str, ...]:
        """Every piece of markup the format writes around calls and reasoning."""
        return tuple(marker for marker in (self.call_open, self.call_close, self.section, self.section_end,
                                           self.header_prefix, self.header_end, *self.think, *self.dropped) if marker)


# What llama.cpp's Hermes 2 Pro parser (common/chat.cpp, common_chat_parse_hermes_2_pro, until the autoparser took
# its place) reads as a call beside <tool_call>: the JSON call {"name": ..., "arguments": ...} in another tag (closed
# by that tag), in a ``` fenced block (```json, ```xml or bare; a tag may stand inside it), or bare; and a header that
# names the function before its JSON arguments, <function=NAME>{...}</function> or <function name="NAME">.
# Qwen2.5-Coder, left to choose, writes its calls as a ```json block.
JSON_TAGS = ("<tool_call>", "<function_call>", "<tool>", "<tools>", "<response>", "<json>", "<xml>", "<JSON>")
FENCE = "```"
BARE_CALL = "{"
FUNCTION_HEADERS = {"<function=": ">", '<function name="': '">'}  # each header's opening, and what ends its name
HERMES_WRAPPINGS = (*JSON_TAGS[1:], FENCE, BARE_CALL, *FUNCTION_HEADERS)
HERMES = CallFormat("Qwen2.5 / Hermes", ("<tool_call>",), "json", "<tool_call>", "</tool_call>",
                    wrappings=HERMES_WRAPPINGS)
QWEN3_CODER = CallFormat("Qwen3-Coder", ("<tool_call>", "<function>", "<function=", "<parameters>", "<parameter="),
                         "xml", "<tool_call>", "</tool_call>")
MISTRAL = CallFormat("Mistral", ("[TOOL_CALLS]",), "json", section="[TOOL_CALLS]", listed=True)
LLAMA3 = CallFormat("Llama 3.x", ("<|start_header_id|>ipython<|end_header_id|>",), "json", arguments="parameters",
                    at_start=True)
DEEPSEEK_R1 = CallFormat("DeepSeek R1 / V3", ("<｜tool▁calls▁begin｜>",), "header", "<｜tool▁call▁begin｜>",
                         "```<｜tool▁call▁end｜>", section="<｜tool▁calls▁begin｜>", section_end="<｜tool▁calls▁end｜>",
                         header_prefix="function<｜tool▁sep｜>", header_end="\n```json\n")
DEEPSEEK_V3_1 = CallFormat("DeepSeek V3.1", ("message['prefix'] is defined and message['prefix'] and thinking",),
                           "header", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", section="<｜tool▁calls▁begin｜>",
                           section_end="<｜tool▁calls▁end｜>", header_end="<｜tool▁sep｜>")
FUNCTIONARY_V3_1 = CallFormat("Functionary v3.1", ("<|start_header_id|>", "<function="), "header", "<function=",
                              "</function>", header_end=">")
FUNCTIONARY_V3_2 = CallFormat("Functionary v3.2", (">>>all",), "header", ">>>", header_end="\n")
COMMAND_R7B = CallFormat("Command R7B", ("<|END_THINKING|><|START_ACTION|>",), "json", section="<|START_ACTION|>",
                         section_end="<|END_ACTION|>", name_key="tool_name", arguments="parameters", listed=True,
                         think=("<|START_THINKING|>", "<|END_THINKING|>"),
                         dropped=("<|START_RESPONSE|>", "<|END_RESPONSE|>"))
GRANITE = CallFormat("Granite", ("elif thinking", "<|tool_call|>"), "json", section="<|tool_call|>", listed=True,
                     dropped=("<response>", "</response>"))
GPT_OSS = CallFormat("GPT-OSS", ("<|channel|>",), "header", " to=functions.", "<|call|>", header_end="<|message|>",
                     think=("<|channel|>analysis<|message|>", "<|end|>"),
                     dropped=("<|start|>assistant", "<|channel|>final<|message|>", "<|channel|>commentary"))
KIMI_K2 = CallFormat("Kimi K2", ("<|im_system|>tool_declare<|im_middle|>", "<|tool_calls_section_begin|>"), "header",
                     "<|tool_call_begin|>", "<|tool_call_end|>", section="<|tool_calls_section_begin|>",
                     section_end="<|tool_calls_section_end|>", header_prefix="functions.",
                     header_end="<|tool_call_argument_begin|>")
FIREFUNCTION_V2 = CallFormat("Firefunction v2", (" functools[",), "json", section=" functools", listed=True)
# llama.cpp's fallback for templates with no tool syntax: the tools described in a system message, and the answer
# one JSON object under a grammar: {"tool_call": {...}}, {"tool_calls": [...]} or {"response": "..."}.
GENERIC = CallFormat("Generic JSON", (), "generic", at_start=True)

# In the order llama.cpp's common_chat_templates_apply_jinja tries them: Qwen3-Coder's template holds <tool_call>
# too, so it is told before Hermes; Functionary v3.1's <|start_header_id|> before Llama 3.x's.
FORMATS = (DEEPSEEK_V3_1, DEEPSEEK_R1, COMMAND_R7B, GRANITE, QWEN3_CODER, HERMES, GPT_OSS, KIMI_K2, FUNCTIONARY_V3_2,
           FIREFUNCTION_V2, FUNCTIONARY_V3_1, LLAMA3, MISTRAL)


def call_format(template: str) -> CallFormat:
    """The call format the chat template asks for: the generic JSON format for a template with no tool syntax;
    ToolError for a model without a template."""
    if not template:
        raise ToolError("this model has no chat template to render tools with; send the request without them",
                        "tools")
    for format_ in FORMATS:
        if all(marker in template for marker in format_.detect):
            return format_
    return GENERIC


def thinking_opened(prompt: str, format_: CallFormat | None) -> bool:
    """Whether the rendered prompt leaves the answer inside the model's reasoning (DeepSeek R1's distills, Qwen3 with
    thinking on: the template writes <think> itself), as llama.cpp tells it: the prompt ends with the opening."""
    opening = (format_ or HERMES).think[0]
    return prompt.endswith(opening) or prompt.endswith(opening + "\n")
