"""llama.cpp's built-in chat templates by name render as llama.cpp's C++ renders them: the expected renderings are
llama.cpp's own (tests/test-chat-template.cpp, its conversation with an answer padded by spaces)."""

from __future__ import annotations

import pytest

from duo.llama.templates import BUILTIN_SOURCES, LLAMA_CPP_NAMES, ChatTemplate

CONVERSATION = [("system", "You are a helpful assistant"), ("user", "Hello"), ("assistant", "Hi there"),
                ("user", "Who are you"), ("assistant", "   I am an assistant   "), ("user", "Another question")]

# name: llama.cpp's expected_output for the template it detects as that name (test-chat-template.cpp).
LLAMA_CPP_EXPECTED = {
    "chatml": "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
              "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n"
              "<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n"
              "<|im_start|>assistant\n",
    "monarch": "system\nYou are a helpful assistant</s>\n<s>user\nHello</s>\n<s>assistant\nHi there</s>\n<s>user\nWho "
               "are you</s>\n<s>assistant\n   I am an assistant   </s>\n<s>user\nAnother question</s>\n<s>assistant\n",
    "gemma": "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\nHi "
             "there<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an "
             "assistant<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n",
    "openchat": "You are a helpful assistant<|end_of_turn|>GPT4 Correct User: Hello<|end_of_turn|>GPT4 Correct "
                "Assistant: Hi there<|end_of_turn|>GPT4 Correct User: Who are you<|end_of_turn|>GPT4 Correct "
                "Assistant:    I am an assistant   <|end_of_turn|>GPT4 Correct User: Another question<|end_of_turn|>"
                "GPT4 Correct Assistant:",
    "deepseek": "You are a helpful assistant### Instruction:\nHello\n### Response:\nHi there\n<|EOT|>\n### "
                "Instruction:\nWho are you\n### Response:\n   I am an assistant   \n<|EOT|>\n### Instruction:\n"
                "Another question\n### Response:\n",
    "vicuna": "You are a helpful assistant\n\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\nASSISTANT:    "
              "I am an assistant   </s>\nUSER: Another question\nASSISTANT:",
    "vicuna-orca": "SYSTEM: You are a helpful assistant\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\n"
                   "ASSISTANT:    I am an assistant   </s>\nUSER: Another question\nASSISTANT:",
    "command-r": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a helpful assistant<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
                 "<|CHATBOT_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Who are you"
                 "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>I am an assistant<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Another question<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
                 "<|CHATBOT_TOKEN|>",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|><|start_header_id|>"
              "user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there"
              "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|><|start_header_id|>"
              "assistant<|end_header_id|>\n\nI am an assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
              "Another question<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "phi3": "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n"
            "<|user|>\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\nAnother question"
            "<|end|>\n<|assistant|>\n",
    "deepseek2": "You are a helpful assistant\n\nUser: Hello\n\nAssistant: Hi there<｜end▁of▁sentence｜>User: Who are "
                 "you\n\nAssistant:    I am an assistant   <｜end▁of▁sentence｜>User: Another question\n\nAssistant:",
    "phi4": "<|im_start|>system<|im_sep|>You are a helpful assistant<|im_end|><|im_start|>user<|im_sep|>Hello"
            "<|im_end|><|im_start|>assistant<|im_sep|>Hi there<|im_end|><|im_start|>user<|im_sep|>Who are you"
            "<|im_end|><|im_start|>assistant<|im_sep|>   I am an assistant   <|im_end|><|im_start|>user<|im_sep|>"
            "Another question<|im_end|><|im_start|>assistant<|im_sep|>",
}


def rendered(name: str, add_generation_prompt: bool = True) -> str:
    template = ChatTemplate(BUILTIN_SOURCES[name], bos_token="<s>", eos_token="</s>")
    return template.render([{"role": role, "content": content} for role, content in CONVERSATION],
                           add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_EXPECTED))
def test_a_built_in_name_renders_llama_cpps_expected_conversation(name: str):
    assert rendered(name) == LLAMA_CPP_EXPECTED[name]


@pytest.mark.parametrize("name", sorted(BUILTIN_SOURCES))
def test_without_the_generation_prompt_the_conversation_ends_with_the_last_message(name: str):
    whole, closed = rendered(name), rendered(name, add_generation_prompt=False)
    assert whole.startswith(closed) and whole != closed


def test_the_names_without_llama_cpps_expected_rendering_write_its_cpp_turns():
    """falcon3, zephyr and deepseek3 have no case in llama.cpp's test: their turns as src/llama-chat.cpp writes
    them."""
    assert rendered("falcon3").endswith("<|user|>\nAnother question\n<|assistant|>\n")
    assert rendered("zephyr").endswith("<|user|>\nAnother question<|endoftext|>\n<|assistant|>\n")
    assert rendered("deepseek3").startswith("You are a helpful assistant\n\n<｜User｜>Hello<｜Assistant｜>Hi there"
                                            "<｜end▁of▁sentence｜>")


def test_every_name_duo_renders_is_one_of_llama_cpps():
    assert set(BUILTIN_SOURCES) <= LLAMA_CPP_NAMES
