"""Errors raised while reading, validating and encoding training data."""
from __future__ import annotations


class DatasetError(ValueError):
    """A data set as a whole cannot be used (too many bad rows, no usable rows, unreadable file)."""


class RowError(ValueError):
    """One row is malformed; its message is the reason reported for that row."""


class ChatTemplateError(ValueError):
    """A chat template renders conversations in a way the label masking cannot follow."""
