"""Validators for the built-in row kinds: each returns the normalised row or raises RowError."""
from __future__ import annotations

from typing import Any

from .errors import RowError
from .messages import parse_arguments

CHAT_ROLES = ("system", "user", "assistant", "tool")
CHAT_ROW_KEYS = frozenset({"messages", "tools"})  # what validate_chat_row reads
TEXT_ROW_KEYS = frozenset({"text"})


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}


def _describe(value: Any) -> str:
    """The JSON type of a parsed value, with its article, for error messages."""
    return "null" if value is None else _JSON_TYPES.get(type(value), f"a {type(value).__name__}")


def _require_object(row: Any) -> dict:
    if not isinstance(row, dict):
        raise RowError(f"row is {_describe(row)}, expected a JSON object")
    return row


def _check_optional_string(message: dict, key: str, where: str) -> None:
    if key in message and not isinstance(message[key], str):
        raise RowError(f"{where}.{key} is {_describe(message[key])}, expected a string")


def _normalise_tool_call(where: str, call: Any) -> dict:
    """One OpenAI-shaped call: {"type": "function", "function": {"name": str, "arguments": object}}, id optional."""
    shape = '{"type": "function", "function": {"name": ..., "arguments": {...}}}'
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise RowError(f"{where} is {_describe(call)} without a 'function' object; each call is {shape}")
    # Parquet fills the keys other calls have (an id, say) with null.
    call = {key: value for key, value in call.items() if value is not None}
    function = {key: value for key, value in call["function"].items() if value is not None}
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise RowError(f"{where}.function.name is {_describe(function.get('name'))}, expected the tool's name")
    if call.get("type", "function") != "function":
        raise RowError(f"{where}.type is {call['type']!r}; only function calls are supported ({shape})")
    _check_optional_string(call, "id", where)
    arguments = parse_arguments(function.get("arguments", {}), f"{where}.function.arguments")
    return {**call, "function": {**function, "arguments": arguments}}


def _normalise_assistant(where: str, message: dict) -> dict:
    """Replies train on their content, reasoning and tool calls; a pure tool call may have no content."""
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list) or not tool_calls:
            raise RowError(f"{where}.tool_calls is {_describe(tool_calls)}, expected a non-empty list of calls")
        message["tool_calls"] = [_normalise_tool_call(f"{where}.tool_calls[{i}]", c) for i, c in enumerate(tool_calls)]
    content = message.get("content")
    if tool_calls is None and (not isinstance(content, str) or not content.strip()):
        raise RowError(f"{where} is an assistant turn with empty or non-string content ({_describe(content)})")
    if content is not None and not isinstance(content, str):
        raise RowError(f"{where}.content is {_describe(content)}, expected a string")
    _check_optional_string(message, "reasoning_content", where)
    return message


def _normalise_message(index: int, message: Any) -> dict:
    """Check one chat message; drop null fields (parquet structs fill absent keys with null)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RowError(f"{where} is {_describe(message)}, expected an object with role and content")
    message = {key: value for key, value in message.items() if value is not None}
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise RowError(f"{where}.role is {role!r}, expected one of {', '.join(CHAT_ROLES)}")
    if "tool_calls" in message and role != "assistant":
        raise RowError(f"{where}.tool_calls must be a list on an assistant message (role is {role!r})")
    if role == "assistant":
        return _normalise_assistant(where, message)
    if not isinstance(message.get("content"), str):
        raise RowError(f"{where}.content is {_describe(message.get('content'))}, expected a string")
    if role == "tool":
        _check_optional_string(message, "tool_call_id", where)
        _check_optional_string(message, "name", where)
    return message


def _validate_tools(tools: Any) -> list[dict] | None:
    """The row's tool schemas, OpenAI-shaped: [{"type": "function", "function": {"name": ..., "parameters": ...}}]."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RowError(f"'tools' is {_describe(tools)}, expected a list of tool schemas")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RowError(f"tools[{index}] is {_describe(tool)} without a named 'function'; each tool is "
                           '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}')
    return tools


def validate_chat_row(row: Any) -> dict:
    """A chat row: {"messages": [{"role", "content"}, ...], "tools": [...] (optional)} with at least one reply.

    Assistant messages may carry reasoning_content and OpenAI-shaped tool_calls (arguments are parsed into
    objects); tool messages carry the result as content, with optional tool_call_id and name.
    """
    row = _require_object(row)
    messages = row.get("messages")
    if messages is None:
        raise RowError("missing 'messages'")
    if not isinstance(messages, list):
        raise RowError(f"'messages' is {_describe(messages)}, expected a list")
    if not messages:
        raise RowError("'messages' is empty")
    tools = _validate_tools(row.get("tools"))
    normalised = [_normalise_message(i, message) for i, message in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in normalised):
        raise RowError("no assistant turn with content or tool calls: nothing to train on")
    result = {**row, "messages": normalised}
    result.pop("tools", None)  # null or [] mean no tools
    if tools:
        result["tools"] = tools
    return result


VISION_FAMILIES = "Qwen 2.5 VL, Qwen3-VL, Qwen 3.5 VL, InternVL"  # the families whose rows may carry media


def validate_text_chat_row(row: Any) -> dict:
    """A chat row for a text-only model: as validate_chat_row, and refused when it carries images or videos
    (the media would be dropped and the text trained alone, silently)."""
    row = _require_object(row)
    media = [key for key in ("images", "videos") if row.get(key)]
    for message in row.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            media += [part["type"] for part in content
                      if isinstance(part, dict) and part.get("type") in ("image", "image_url", "video", "video_url")]
    if media:
        raise RowError(f"the row carries {', '.join(sorted(set(media)))}, but this run's model reads text only (its "
                       f"media would be dropped); images and videos train on vision-language families: "
                       f"{VISION_FAMILIES}")
    return validate_chat_row(row)


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
