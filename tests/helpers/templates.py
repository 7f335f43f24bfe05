"""Chat templates shared by the tests of rendering and of the served launch flags."""

from __future__ import annotations

# The end of QwQ's template as llama.cpp's models/templates carries it: thinking off closes the think block.
THINKING = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
            "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
            "{%- if not enable_thinking -%}{{- '</think>' -}}{%- endif -%}{%- endif %}")
