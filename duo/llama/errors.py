"""The model layer's error, shared by duo.llama.model and duo.llama.backends."""


class ModelError(Exception):
    """A model cannot be loaded or used as asked; the message says what to change."""
