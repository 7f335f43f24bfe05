"""Chat templates as llama-server renders them: its Jinja engine's ways and variables, its built-in templates by name."""

from duo.llama.templates.builtin import BUILTIN_SOURCES, LLAMA_CPP_NAMES
from duo.llama.templates.render import ChatTemplate, reserved_names

__all__ = ["BUILTIN_SOURCES", "LLAMA_CPP_NAMES", "ChatTemplate", "reserved_names"]
