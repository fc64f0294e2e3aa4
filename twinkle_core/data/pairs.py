"""Embedding rows: a query, its positive passage(s) and hard negatives, for contrastive (InfoNCE) training.

Accepted layouts (each normalised to {"query", "positives", "negatives"}):

    {"query": str, "positive": str | [str], "negatives": [str]}              # ours ("negative": str also)
    {"anchor": str, "positive": str, "negative": str | [str]}                # sentence-transformers' triplets
    {"messages": [...], "positive_messages": [[...]], "negative_messages": [[...], ...]}   # ms-swift

A row with several positives becomes one example per positive (the same query text: the loss masks the
others as false negatives). Every text is truncated on its own to max_length tokens.
"""
from __future__ import annotations

from typing import Any

import torch

from .errors import RowError

_TEXT_KEYS = ("query_ids", "positive_ids")
ROW_KEYS = frozenset({"query", "anchor", "positive", "positives", "negative", "negatives",  # all layouts
                      "messages", "positive_messages", "negative_messages"})
BATCH_KEYS = ("query_input_ids", "query_attention_mask", "doc_input_ids", "doc_attention_mask")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        kind = "an empty string" if isinstance(value, str) else type(value).__name__ if value is not None else "null"
        raise RowError(f"{where} is {kind}, expected a non-empty string")
    return value


def _texts(value: Any, where: str, required: bool) -> list[str]:
    if value is None:
        if required:
            raise RowError(f"{where} is missing, expected a string or a list of strings")
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or (required and not values):
        raise RowError(f"{where} is {type(value).__name__}, expected a string or a non-empty list of strings")
    return [_text(text, f"{where}[{i}]") for i, text in enumerate(values)]


def _conversation_text(messages: Any, where: str) -> str:
    """The text of an ms-swift message list: its contents joined by newlines."""
    if not isinstance(messages, list) or not messages:
        raise RowError(f"{where} is {type(messages).__name__}, expected a non-empty list of messages")
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"{where}[{i}] is {type(message).__name__}, expected a message object")
        parts.append(_text(message.get("content"), f"{where}[{i}].content"))
    return "\n".join(parts)


def _conversations(value: Any, where: str, required: bool) -> list[str]:
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value):
        raise RowError(f"{where} is {type(value).__name__}, expected a list of message lists")
    return [_conversation_text(messages, f"{where}[{i}]") for i, messages in enumerate(value)]


def validate_pair_row(row: Any) -> dict:
    """{"query": str, "positives": [str, ...], "negatives": [str, ...]} from any accepted layout."""
    if not isinstance(row, dict):
        raise RowError(f"row is {type(row).__name__}, expected a JSON object")
    if "messages" in row:
        query = _conversation_text(row["messages"], "messages")
        positives = _conversations(row.get("positive_messages"), "positive_messages", True)
        negatives = _conversations(row.get("negative_messages"), "negative_messages", False)
    elif "query" in row or "anchor" in row:
        key = "query" if "query" in row else "anchor"
        query = _text(row[key], key)
        positives = _texts(row.get("positive", row.get("positives")), "positive", True)
        negatives = _texts(row.get("negatives", row.get("negative")), "negatives", False)
    else:
        raise RowError(f"row has keys {sorted(row)}; an embedding row needs 'query' (or 'anchor', or ms-swift's "
                       "'messages') and 'positive'")
    shared = set(positives) & set(negatives)
    if shared:
        raise RowError(f"a negative is identical to a positive ({sorted(shared)[0][:60]!r}): it cannot be both")
    return {"query": query, "positives": positives, "negatives": negatives}


def encode_text_ids(tokenizer, text: str, append_eos: bool = False) -> list[int]:
    """A text's ids with the tokenizer's special tokens ([CLS] … [SEP] for BERT); `append_eos` ends it with EOS
    (last-token pooling reads the state at EOS, as Qwen3-Embedding was trained)."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if append_eos and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
    return ids


def encode_pair_row(tokenizer, row: dict, enable_thinking: bool = True, query_prompt: str = "",
                    append_eos: bool = False) -> list[dict]:
    """One example per positive: query (with its prompt), positive and negatives as token ids."""
    query = encode_text_ids(tokenizer, query_prompt + row["query"], append_eos)
    negatives = [encode_text_ids(tokenizer, text, append_eos) for text in row["negatives"]]
    return [{"query_ids": query, "positive_ids": encode_text_ids(tokenizer, positive, append_eos),
             "negative_ids": negatives} for positive in row["positives"]]


def truncate_pair(example: dict, max_length: int) -> dict:
    """Each text cut to max_length tokens on its own."""
    out = {key: example[key][:max_length] for key in _TEXT_KEYS}
    out["negative_ids"] = [ids[:max_length] for ids in example["negative_ids"]]
    return out


def was_truncated(example: dict, max_length: int) -> bool:
    return any(len(ids) > max_length for ids in _texts_of(example))


def _texts_of(example: dict) -> list[list[int]]:
    return [example["query_ids"], example["positive_ids"], *example["negative_ids"]]


def num_texts(example: dict) -> int:
    return 2 + len(example["negative_ids"])


def count_pair_tokens(example: dict) -> tuple[int, int]:
    """(tokens, trained tokens): every token of every text is encoded, and trained."""
    tokens = sum(len(ids) for ids in _texts_of(example))
    return tokens, tokens


def _padded(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids, mask


def _key(ids: list[int]) -> int:
    """Equal token ids give equal keys on every process (tuples of ints hash the same everywhere)."""
    return hash(tuple(ids))


def collate_pairs(examples: list[dict], pad_token_id: int | None, mask_dtype: torch.dtype = torch.float32) -> dict:
    """Right-padded queries and documents: the positives (doc i is row i's) first, then every hard negative.

    `negative_row` says whose hard negative each is; the keys mark identical texts (false negatives); a row
    with `masked` (a data-parallel rank's stand-in for an empty share) is encoded but neither trained nor a
    candidate.
    """
    if not examples:
        raise ValueError("collate_pairs needs at least one example")
    if pad_token_id is None:
        raise ValueError("pad_token_id is None; set tokenizer.pad_token before batching")
    negatives = [(row, ids) for row, example in enumerate(examples) for ids in example["negative_ids"]]
    docs = [example["positive_ids"] for example in examples] + [ids for _, ids in negatives]
    query_ids, query_mask = _padded([example["query_ids"] for example in examples], pad_token_id)
    doc_ids, doc_mask = _padded(docs, pad_token_id)
    return {
        "query_input_ids": query_ids, "query_attention_mask": query_mask,
        "doc_input_ids": doc_ids, "doc_attention_mask": doc_mask,
        "negative_row": torch.tensor([row for row, _ in negatives], dtype=torch.long),
        "query_key": torch.tensor([_key(example["query_ids"]) for example in examples], dtype=torch.long),
        "doc_key": torch.tensor([_key(ids) for ids in docs], dtype=torch.long),
        "row_valid": torch.tensor([not example.get("masked") for example in examples], dtype=torch.bool),
    }


def merge_pair_batches(chunks: list[dict]) -> tuple[dict, list[slice], list[slice]]:
    """The bookkeeping of one batch made of collated `chunks` (ids are not merged: each chunk is embedded on
    its own), and where each chunk's positives and negatives sit among the merged documents."""
    rows = [len(chunk["query_key"]) for chunk in chunks]
    negatives = [len(chunk["negative_row"]) for chunk in chunks]
    row_offsets = [sum(rows[:i]) for i in range(len(chunks))]
    total_rows = sum(rows)
    positive_at = [slice(row_offsets[i], row_offsets[i] + rows[i]) for i in range(len(chunks))]
    negative_at = [slice(total_rows + sum(negatives[:i]), total_rows + sum(negatives[:i + 1]))
                   for i in range(len(chunks))]
    merged = {
        "negative_row": torch.cat([chunk["negative_row"] + offset for chunk, offset in zip(chunks, row_offsets)]),
        "query_key": torch.cat([chunk["query_key"] for chunk in chunks]),
        "row_valid": torch.cat([chunk["row_valid"] for chunk in chunks]),
        "doc_key": torch.cat([chunk["doc_key"][:n] for chunk, n in zip(chunks, rows)]
                             + [chunk["doc_key"][n:] for chunk, n in zip(chunks, rows)]),
    }
    return merged, positive_at, negative_at
