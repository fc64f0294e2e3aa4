"""Validators for the built-in row kinds: each returns the normalised row or raises RowError."""
from __future__ import annotations

from typing import Any

from .errors import RowError

CHAT_ROLES = ("system", "user", "assistant", "tool")


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}


def _describe(value: Any) -> str:
    """The JSON type of a parsed value, with its article, for error messages."""
    return "null" if value is None else _JSON_TYPES.get(type(value), f"a {type(value).__name__}")


def _require_object(row: Any) -> dict:
    if not isinstance(row, dict):
        raise RowError(f"row is {_describe(row)}, expected a JSON object")
    return row


def _normalise_message(index: int, message: Any) -> dict:
    """Check one chat message; drop null fields (parquet structs fill absent keys with null)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RowError(f"{where} is {_describe(message)}, expected an object with role and content")
    message = {key: value for key, value in message.items() if value is not None}
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise RowError(f"{where}.role is {role!r}, expected one of {', '.join(CHAT_ROLES)}")
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and (role != "assistant" or not isinstance(tool_calls, list)):
        raise RowError(f"{where}.tool_calls must be a list on an assistant message (role is {role!r})")
    if role == "assistant":
        if content is None and tool_calls:
            return message  # a pure tool call: nothing to train on yet, kept for tool-use rows
        if not isinstance(content, str) or not content.strip():
            raise RowError(f"{where} is an assistant turn with empty or non-string content ({_describe(content)})")
    elif not isinstance(content, str):
        raise RowError(f"{where}.content is {_describe(content)}, expected a string")
    return message


def validate_chat_row(row: Any) -> dict:
    """A chat row: {"messages": [{"role", "content"}, ...]} with at least one non-empty assistant turn."""
    row = _require_object(row)
    messages = row.get("messages")
    if messages is None:
        raise RowError("missing 'messages'")
    if not isinstance(messages, list):
        raise RowError(f"'messages' is {_describe(messages)}, expected a list")
    if not messages:
        raise RowError("'messages' is empty")
    normalised = [_normalise_message(i, message) for i, message in enumerate(messages)]
    if not any(m["role"] == "assistant" and isinstance(m.get("content"), str) for m in normalised):
        raise RowError("no assistant turn with content: nothing to train on")
    return {**row, "messages": normalised}


def validate_text_row(row: Any) -> dict:
    """A pre-training row: {"text": non-empty string}."""
    row = _require_object(row)
    if "text" not in row:
        raise RowError("missing 'text'")
    text = row["text"]
    if not isinstance(text, str):
        raise RowError(f"'text' is {_describe(text)}, expected a string")
    if not text.strip():
        raise RowError("'text' is empty")
    return row
