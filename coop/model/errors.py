"""The model layer's error for a model it cannot use, in a module of its own so that any layer can
catch it without importing a tower."""


class ModelError(ValueError):
    """The model name, pretrained tag, weights file or tower cannot be used; the message says which."""
