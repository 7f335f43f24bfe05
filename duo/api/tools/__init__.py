"""Tool calls: OpenAI's `tools` rendered by the model's own chat template, the call format of each template family
(formats; the calls are read out of the model's text by duo.api.output.calls), and a grammar that writes a call where
the client requires one (grammars).

The format is the model's, told by its template as llama.cpp's chat layer tells it: Hermes / Qwen2.5's
<tool_call> JSON, Qwen3-Coder's XML, Mistral's [TOOL_CALLS], Llama 3.x's bare JSON, DeepSeek R1 / V3 and V3.1,
Functionary v3.1 and v3.2, Command R7B, Granite, GPT-OSS, Kimi K2, Firefunction v2, and for a template with no tool
syntax the generic JSON answer. Hermes-style templates' calls are read in every wrapping llama.cpp's Hermes 2 Pro
parser reads (formats.HERMES_WRAPPINGS): Qwen2.5-Coder, given a tool and `tool_choice: auto`, writes its calls as a
```json block, not in its template's tags. Text that is not a well-formed call of a tool the request offered stays
content; `tool_choice: required` or a named function makes a grammar write the template's own format, so the call
always parses, and under `auto` a lazy grammar does the same from the moment the model opens a call with its
template's opening token, as llama-server's lazy grammar does.
"""

from duo.api.tools.formats import (COMMAND_R7B, DEEPSEEK_R1, DEEPSEEK_V3_1, FIREFUNCTION_V2, FORMATS,
                                   FUNCTIONARY_V3_1, FUNCTIONARY_V3_2, GENERIC, GPT_OSS, GRANITE, HERMES, KIMI_K2,
                                   LLAMA3, MISTRAL, QWEN3_CODER, CallFormat, call_format, thinking_opened)
from duo.api.tools.grammars import call_grammar, lazy_call_grammar
from duo.api.tools.messages import (FunctionBody, NamedToolChoice, ToolBody, ToolCall, ToolChoice, ToolError,
                                    ToolUse, template_message, tool_use, with_tools_described)

__all__ = ["COMMAND_R7B", "DEEPSEEK_R1", "DEEPSEEK_V3_1", "FIREFUNCTION_V2", "FORMATS", "FUNCTIONARY_V3_1",
           "FUNCTIONARY_V3_2", "GENERIC", "GPT_OSS", "GRANITE", "HERMES", "KIMI_K2", "LLAMA3", "MISTRAL", "QWEN3_CODER",
           "CallFormat", "FunctionBody", "NamedToolChoice", "ToolBody", "ToolCall", "ToolChoice", "ToolError",
           "ToolUse", "call_format", "call_grammar", "lazy_call_grammar", "template_message", "thinking_opened",
           "tool_use", "with_tools_described"]
