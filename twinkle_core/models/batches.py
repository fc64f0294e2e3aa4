"""Turn the `inputs` of forward_backward (chat rows or an encoded batch) into device tensors."""
from __future__ import annotations

from typing import Any

import torch

from twinkle_core.data import collate, encode_chat


def to_batch(inputs: list[dict] | dict, tokenizer: Any, device: torch.device, max_length: int | None) -> dict:
    """Chat rows are encoded with the model's chat template and collated; dicts are moved as they are."""
    if isinstance(inputs, list):
        if not inputs:
            raise ValueError("inputs: an empty list of rows; pass at least one chat row.")
        examples = [encode_chat(tokenizer, _messages_of(row), max_length=max_length,
                                tools=row.get("tools") if isinstance(row, dict) else None) for row in inputs]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        inputs = collate(examples, pad_token_id=pad)
    if not isinstance(inputs, dict) or "input_ids" not in inputs or "labels" not in inputs:
        raise ValueError(
            "inputs must be a list of chat rows ({'messages': [...]}) or a dict with 'input_ids', 'labels' "
            "and 'attention_mask' or 'position_ids'."
        )
    return {k: torch.as_tensor(v).to(device) for k, v in inputs.items()}


def _messages_of(row: dict | list) -> list[dict]:
    if isinstance(row, dict) and "messages" in row:
        return row["messages"]
    if isinstance(row, list):
        return row
    raise ValueError(f"inputs: a chat row needs a 'messages' list; got {type(row).__name__} {str(row)[:80]!r}.")


def count_input_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding tokens in a batch (all tokens when there is no 2-D attention mask)."""
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return int(mask.sum())
    return batch["input_ids"].numel()
