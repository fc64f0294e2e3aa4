"""Errors raised while reading, validating and encoding training data."""
from __future__ import annotations

from twinkle_core.errors import UserError


class DatasetError(UserError):
    """A data set as a whole cannot be used (too many bad rows, no usable rows, unreadable file)."""


class RowError(UserError):
    """One row is malformed; its message is the reason reported for that row."""


class ChatTemplateError(UserError):
    """A chat template renders conversations in a way the label masking cannot follow."""
