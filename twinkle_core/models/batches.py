"""Turn the `inputs` of forward_backward (chat rows or an encoded batch) into device tensors (a Batch that keeps
its host copy: twinkle_core.data.device_batch)."""
from __future__ import annotations

from typing import Any

import torch

from twinkle_core.data import collate, collate_padding_free, encode_chat, get_row_format
from twinkle_core.data.device_batch import HOST_KEYS, Batch, host_of, to_device  # noqa: F401 (re-exported)


def to_batch(inputs: list[dict] | dict, tokenizer: Any, device: torch.device, max_length: int | None,
             kind: str = "chat", encode_options: dict | None = None, encoder: Any = None,
             padding_free: bool = False) -> dict:
    """Rows are encoded (chat rows with the model's chat template) and collated; dicts are moved as they are.

    `encoder`: what the row kind encodes with in the tokenizer's place (a vision model's processor);
    `padding_free`: rows are collated end to end in one row (collate_padding_free), for a model that takes it."""
    if kind != "chat":
        return _rows_batch(inputs, tokenizer, device, max_length, kind, encode_options or {}, encoder or tokenizer,
                           padding_free)
    if isinstance(inputs, list):
        if not inputs:
            raise ValueError("inputs: an empty list of rows; pass at least one chat row.")
        examples = [encode_chat(tokenizer, _messages_of(row), max_length=max_length,
                                tools=row.get("tools") if isinstance(row, dict) else None) for row in inputs]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        inputs = collate_padding_free(examples) if padding_free else collate(examples, pad_token_id=pad)
    if not isinstance(inputs, dict) or "input_ids" not in inputs or "labels" not in inputs:
        raise ValueError(
            "inputs must be a list of chat rows ({'messages': [...]}) or a dict with 'input_ids', 'labels' "
            "and 'attention_mask' or 'position_ids'."
        )
    return to_device(inputs, device)


def _rows_batch(inputs: list[dict] | dict, tokenizer: Any, device: torch.device, max_length: int | None,
                kind: str, encode_options: dict, encoder: Any, padding_free: bool = False) -> dict:
    """Rows of another kind (e.g. embedding pairs) through their row format; a collated dict as it is."""
    row_format = get_row_format(kind)
    if isinstance(inputs, list):
        if not inputs:
            raise ValueError(f"inputs: an empty list of rows; pass at least one {kind} row.")
        examples = []
        for row in inputs:
            encoded = row_format.encode(encoder, row_format.check(row), **encode_options)  # paths: from the cwd
            encoded = encoded if isinstance(encoded, list) else [encoded]  # a row may give several examples
            examples += [row_format.truncate(e, max_length) if max_length else e for e in encoded]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        padding_free = padding_free and row_format.collate_padding_free is not None
        inputs = row_format.collate_padding_free(examples) if padding_free else row_format.collate(examples,
                                                                                                  pad_token_id=pad)
    missing = [key for key in row_format.batch_keys if not isinstance(inputs, dict) or key not in inputs]
    if missing:
        raise ValueError(f"inputs must be a list of {kind} rows or a collated batch dict; missing {missing}.")
    return to_device(inputs, device)


def _messages_of(row: dict | list) -> list[dict]:
    if isinstance(row, dict) and "messages" in row:
        return row["messages"]
    if isinstance(row, list):
        return row
    raise ValueError(f"inputs: a chat row needs a 'messages' list; got {type(row).__name__} {str(row)[:80]!r}.")


def count_input_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding tokens in a batch (all tokens when there is no 2-D attention mask), a shared prefix counted in
    every sample that reads it; every 2-D *attention_mask (an embedding batch has one for queries and one for
    documents) counts."""
    batch = host_of(batch) or batch  # counted on the host where the batch was collated
    masks = [v for k, v in batch.items() if k.endswith("attention_mask") and v.dim() == 2]
    tokens = sum(int(mask.sum()) for mask in masks) if masks else batch["input_ids"].numel()
    if "prefix_spans" in batch:  # a padding-free row holds a shared prefix once for the samples that read it
        tokens += int(batch["prefix_spans"][:, 1].sum())
    return tokens
