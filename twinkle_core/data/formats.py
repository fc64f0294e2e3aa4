"""Row kinds: how a row of each kind is validated and encoded, in a registry new kinds can join.

Embedding (query/positive/negatives), VLM (images) and preference (chosen/rejected) rows register
here with their own validator and encoder; load_rows and tokenize_dataset only look kinds up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from twinkle_core.config.registry import Registry

from .encode import encode_chat, encode_text
from .validate import validate_chat_row, validate_text_row


@dataclass(frozen=True)
class RowFormat:
    """A row kind: `validate(row)` returns the normalised row or raises RowError;
    `encode(tokenizer, row, enable_thinking=...)` returns a dict of per-token lists (at least input_ids and
    labels), untruncated; kinds without replies to think about ignore enable_thinking."""

    kind: str
    validate: Callable[[Any], dict]
    encode: Callable[..., dict]
    needs_chat_template: bool = True  # its rows are rendered with the tokenizer's chat template


_FORMATS: Registry[RowFormat] = Registry("kind", "row kind")


def register_row_format(row_format: RowFormat) -> RowFormat:
    """Add a row kind; a kind can be registered only once."""
    return _FORMATS.register(row_format.kind, row_format)


def get_row_format(kind: str) -> RowFormat:
    """The registered format of `kind`."""
    return _FORMATS.get(kind)


def row_kinds() -> list[str]:
    """The registered row kinds, sorted."""
    return _FORMATS.names()


def _encode_chat_row(tokenizer, row: dict, enable_thinking: bool = True) -> dict:
    return encode_chat(tokenizer, row["messages"], tools=row.get("tools"), enable_thinking=enable_thinking)


def _encode_text_row(tokenizer, row: dict, enable_thinking: bool = True) -> dict:
    return encode_text(tokenizer, row["text"])


register_row_format(RowFormat("chat", validate_chat_row, _encode_chat_row))
register_row_format(RowFormat("text", validate_text_row, _encode_text_row, needs_chat_template=False))
