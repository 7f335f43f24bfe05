"""The model layer's error, shared by duo.model and duo.backends."""


class ModelError(Exception):
    """A model cannot be loaded or used as asked; the message says what to change."""
