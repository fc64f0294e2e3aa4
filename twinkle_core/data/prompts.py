"""Prompt rows for online RL (GRPO): a conversation ending with a user turn, and the row's other fields
(e.g. `solution`) that the reward functions read.

    {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "solution": "7"}
    {"prompt": "What is 3 + 4?", "solution": "7"}                      # trl's layout (string or messages)

An example holds `prompt_ids` (the conversation and the assistant header, ready for generation), the
last user message as `prompt_text`, and the other fields as one JSON object in `fields`.
"""
from __future__ import annotations

import json
from typing import Any

from .encode import encode_prompt
from .errors import RowError
from .preference import prompt_messages

PROMPT_KEYS = ("messages", "prompt")
BATCH_KEYS = ("input_ids", "labels", "advantages")  # a batch of sampled completions (twinkle_core.rl.sampler)


def validate_prompt_row(row: Any) -> dict:
    if not isinstance(row, dict):
        raise RowError(f"row is {type(row).__name__}, expected a JSON object")
    key = next((k for k in PROMPT_KEYS if k in row), None)
    if key is None:
        raise RowError(f"row has keys {sorted(row)}; a prompt row needs 'messages' or 'prompt'")
    messages = prompt_messages(row[key], key)
    fields = {k: v for k, v in row.items() if k not in PROMPT_KEYS}
    try:
        json.dumps(fields)
    except TypeError as exc:
        raise RowError(f"the row's other fields are not JSON ({exc})") from exc
    return {"messages": messages, "fields": fields}


def encode_prompt_row(tokenizer, row: dict, enable_thinking: bool = True) -> dict:
    ids = encode_prompt(tokenizer, row["messages"], enable_thinking=enable_thinking)
    return {"prompt_ids": ids, "prompt_text": row["messages"][-1]["content"],
            "fields": json.dumps(row["fields"], ensure_ascii=False, sort_keys=True)}


def truncate_prompt(example: dict, max_length: int) -> dict:
    """A prompt is never cut (the model would answer another question): one longer than max_length is
    emptied, which makes it a bad row."""
    return example if len(example["prompt_ids"]) <= max_length else {**example, "prompt_ids": []}


def prompt_too_long(example: dict, max_length: int) -> bool:
    return len(example["prompt_ids"]) > max_length


def count_prompt_tokens(example: dict) -> tuple[int, int]:
    return len(example["prompt_ids"]), len(example["prompt_ids"])


def no_collate(examples: list[dict], **_) -> dict:
    raise TypeError("prompt rows are sampled from, not trained on: the GRPO recipe (twinkle_core.train.grpo) "
                    "batches their sampled completions")
