"""Declared user errors: what `cisjax` reports as one line (no traceback); any other exception is a bug and shows its traceback."""

from __future__ import annotations

__all__ = ["UserError", "MissingInput", "CheckpointError"]


class UserError(ValueError):
    """Bad input from the user (flags, config fields, input files, unknown names): the CLI prints one line, no
    traceback. A ValueError, so `except ValueError` and `pytest.raises(ValueError)` still catch it."""


class MissingInput(UserError, FileNotFoundError):
    """A path the user named does not exist."""


class CheckpointError(UserError):
    """A checkpoint that does not fit the model: names the tensor or config field. A user error (the model or
    checkpoint directory the user named): the CLI reports it in one line."""
