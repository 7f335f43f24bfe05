"""llama.cpp's built-in chat templates by name (src/llama-chat.cpp, C++ there) as Jinja sources that render alike."""

from __future__ import annotations

# Every name llama.cpp's --chat-template knows (llama_chat_builtin_templates).
LLAMA_CPP_NAMES = frozenset({
    "chatml", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "mistral-v1", "mistral-v3",
    "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken", "phi3", "phi4", "falcon3", "zephyr", "monarch", "gemma",
    "orion", "openchat", "vicuna", "vicuna-orca", "deepseek", "deepseek2", "deepseek3", "deepseek-ocr", "command-r",
    "llama3", "chatglm3", "chatglm4", "glmedge", "minicpm", "exaone3", "exaone4", "exaone-moe", "rwkv-world",
    "granite", "granite-4.0", "granite-4.1", "gigachat", "megrez", "yandex", "bailing", "bailing-think", "bailing2",
    "llama4", "smolvlm", "hunyuan-moe", "gpt-oss", "hunyuan-dense", "hunyuan-vl", "kimi-k2", "seed_oss", "grok-2",
    "pangu-embedded", "solar-open"})


def _each_role(turns: dict[str, str], generation_prompt: str) -> str:
    """A template that writes each message by its role (`turns`: a Jinja expression per role, `message` and
    `content` in scope; roles not listed are left out, as llama.cpp's C++ leaves them), then `generation_prompt`."""
    branches = "".join(f"{'if' if i == 0 else 'elif'} message.role == '{role}' -%}}{{{{- {text} -}}}}{{%-"
                       for i, (role, text) in enumerate(turns.items()))
    return ("{%- for message in messages -%}{%- set content = message.content if message.content is string else '' -%}"
            f"{{%- {branches} endif -%}}{{%- endfor -%}}"
            f"{{%- if add_generation_prompt -%}}{{{{- {generation_prompt!r} -}}}}{{%- endif -%}}")


def _any_role(turn: str, generation_prompt: str) -> str:
    """A template that writes every message alike (`turn`: a Jinja expression, `message` and `content` in scope)."""
    return ("{%- for message in messages -%}{%- set content = message.content if message.content is string else '' -%}"
            f"{{{{- {turn} -}}}}{{%- endfor -%}}"
            f"{{%- if add_generation_prompt -%}}{{{{- {generation_prompt!r} -}}}}{{%- endif -%}}")


# Gemma has no system role: llama.cpp puts the system messages, trimmed, at the head of the next user turn.
_GEMMA = ("{%- set ns = namespace(system='') -%}"
          "{%- for message in messages -%}{%- set content = message.content if message.content is string else '' -%}"
          "{%- if message.role == 'system' -%}{%- set ns.system = ns.system + content | trim -%}"
          "{%- else -%}{%- set role = 'model' if message.role == 'assistant' else message.role -%}"
          "{{- '<start_of_turn>' + role + '\\n' -}}"
          "{%- if ns.system and role != 'model' -%}{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}{%- endif -%}"
          "{{- content | trim + '<end_of_turn>\\n' -}}{%- endif -%}{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}")


# The names duo renders, each as llama.cpp's C++ writes it (tests/llama/test_builtin_templates.py holds llama.cpp's
# expected renderings, tests/test-chat-template.cpp); chatml is the Jinja source llama.cpp's common/chat.cpp uses.
BUILTIN_SOURCES: dict[str, str] = {
    "chatml": _any_role("'<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n'", "<|im_start|>assistant\n"),
    "llama3": _any_role("'<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + content | trim + "
                        "'<|eot_id|>'", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "command-r": _each_role({
        "system": "'<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + content | trim + '<|END_OF_TURN_TOKEN|>'",
        "user": "'<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + content | trim + '<|END_OF_TURN_TOKEN|>'",
        "assistant": "'<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' + content | trim + '<|END_OF_TURN_TOKEN|>'"},
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    "phi3": _any_role("'<|' + message.role + '|>\\n' + content + '<|end|>\\n'", "<|assistant|>\n"),
    "phi4": _any_role("'<|im_start|>' + message.role + '<|im_sep|>' + content + '<|im_end|>'",
                      "<|im_start|>assistant<|im_sep|>"),
    "falcon3": _any_role("'<|' + message.role + '|>\\n' + content + '\\n'", "<|assistant|>\n"),
    "zephyr": _any_role("'<|' + message.role + '|>\\n' + content + '<|endoftext|>\\n'", "<|assistant|>\n"),
    "gemma": _GEMMA,
    # AlphaMonarch writes a BOS before every message but the first (the tokenizer adds that one).
    "monarch": _any_role("('' if loop.first else '<s>') + message.role + '\\n' + content + '</s>\\n'",
                         "<s>assistant\n"),
    "openchat": _each_role({
        "system": "content + '<|end_of_turn|>'",
        "user": "'GPT4 Correct User: ' + content + '<|end_of_turn|>'",
        "assistant": "'GPT4 Correct Assistant: ' + content + '<|end_of_turn|>'"}, "GPT4 Correct Assistant:"),
    "vicuna": _each_role({"system": "content + '\\n\\n'", "user": "'USER: ' + content + '\\n'",
                          "assistant": "'ASSISTANT: ' + content + '</s>\\n'"}, "ASSISTANT:"),
    "vicuna-orca": _each_role({"system": "'SYSTEM: ' + content + '\\n'", "user": "'USER: ' + content + '\\n'",
                               "assistant": "'ASSISTANT: ' + content + '</s>\\n'"}, "ASSISTANT:"),
    "deepseek": _each_role({"system": "content", "user": "'### Instruction:\\n' + content + '\\n'",
                            "assistant": "'### Response:\\n' + content + '\\n<|EOT|>\\n'"}, "### Response:\n"),
    "deepseek2": _each_role({"system": "content + '\\n\\n'", "user": "'User: ' + content + '\\n\\n'",
                             "assistant": "'Assistant: ' + content + '<｜end▁of▁sentence｜>'"}, "Assistant:"),
    "deepseek3": _each_role({"system": "content + '\\n\\n'", "user": "'<｜User｜>' + content",
                             "assistant": "'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'"}, "<｜Assistant｜>"),
}
