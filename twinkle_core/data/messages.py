"""Put chat messages in the one shape every chat template reads: reasoning apart, tool-call arguments as objects."""
from __future__ import annotations

import json
from typing import Any

from .errors import RowError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def parse_arguments(arguments: Any, where: str) -> dict:
    """Tool-call arguments as a dict; a JSON string (the OpenAI wire form) is parsed.

    Templates write arguments as objects (`| tojson`, one XML parameter per key), so every row gets one form.
    """
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise RowError(f"{where} is not valid JSON ({error}): {arguments[:80]!r}; write the arguments as an "
                           "object or a JSON-encoded object") from None
        if isinstance(parsed, dict):
            return parsed
    raise RowError(f"{where} is {arguments!r:.80}, expected an object of argument names to values "
                   "(or a JSON string holding one)")


def split_inline_reasoning(content: str) -> tuple[str | None, str]:
    """(reasoning, reply) of a reply that opens with `<think>...</think>`; (None, content) otherwise."""
    stripped = content.lstrip()
    if not stripped.startswith(THINK_OPEN) or THINK_CLOSE not in stripped:
        return None, content
    reasoning, _, reply = stripped[len(THINK_OPEN):].partition(THINK_CLOSE)
    return reasoning.strip(), reply.lstrip()


def _normalise_call(call: dict, where: str) -> dict:
    function = call["function"]
    arguments = parse_arguments(function.get("arguments", {}), f"{where}.function.arguments")
    return {**call, "function": {**function, "arguments": arguments}}


def _normalise_assistant(message: dict, index: int, enable_thinking: bool) -> dict:
    message = dict(message)
    content = message.get("content") or ""  # a pure tool call has none; templates concatenate strings
    reasoning = message.pop("reasoning_content", None)
    if reasoning is None:
        reasoning, content = split_inline_reasoning(content)
    message["content"] = content
    if reasoning and enable_thinking:
        message["reasoning_content"] = reasoning
    if message.get("tool_calls"):
        message["tool_calls"] = [
            _normalise_call(call, f"messages[{index}].tool_calls[{number}]")
            for number, call in enumerate(message["tool_calls"])
        ]
    return message


def normalise_messages(messages: list[dict], enable_thinking: bool = True) -> list[dict]:
    """Copies of `messages` ready to render.

    Assistant turns get their reasoning in `reasoning_content` (moved out of an inline `<think>` block), or none
    at all with enable_thinking=False, so the model is trained to answer without thinking; a string content
    even for pure tool calls; and tool-call arguments as dicts.
    """
    return [
        _normalise_assistant(message, index, enable_thinking) if message.get("role") == "assistant" else message
        for index, message in enumerate(messages)
    ]
