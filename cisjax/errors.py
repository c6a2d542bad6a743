"""Declared user errors: what `cisjax` reports as one line (no traceback); any other exception is a bug and shows its traceback."""

from __future__ import annotations

__all__ = ["UserError", "MissingInput"]


class UserError(ValueError):
    """Bad input from the user (flags, config fields, input files, unknown names): the CLI prints one line, no
    traceback. A ValueError, so `except ValueError` and `pytest.raises(ValueError)` still catch it."""


class MissingInput(UserError, FileNotFoundError):
    """A path the user named does not exist."""
