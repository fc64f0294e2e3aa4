"""Preference rows: a prompt conversation with a chosen and a rejected assistant reply (DPO and its kin).

Accepted layouts (each normalised to {"messages": prompt, "chosen": reply, "rejected": reply}):

    {"messages": [...], "chosen": str | message, "rejected": str | message}          # ours
    {"prompt": str | [...], "chosen": str | [message], "rejected": str | [message]}     # trl's
    {"messages": [..., {"role": "assistant", ...}], "rejected_response": str}         # ms-swift's

Both replies are rendered after the prompt with the model's chat template; only the final reply's tokens
(and its end-of-turn token) are labelled, earlier assistant turns of the prompt are context. A collated
batch holds the chosen sequences first and the rejected ones after them, so one forward scores both; a
padding-free one holds each pair's prompt once (the rejected reply continues the chosen sequence's prompt).
"""
from __future__ import annotations

from typing import Any

import torch

from .collate import PaddingFreeRow, collate, shared_prefix_length
from .encode import IGNORE_INDEX, count_trained_tokens, encode_chat
from .errors import RowError
from .validate import validate_chat_row

SIDES = ("chosen", "rejected")
REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")  # precomputed reference log-probs, when present
BATCH_KEYS = ("input_ids", "labels", "attention_mask")
ROW_KEYS = frozenset({"messages", "prompt", "chosen", "rejected", "rejected_response", *REFERENCE_KEYS})  # all layouts


def _reply(value: Any, where: str) -> dict:
    """An assistant message from a string, a message, or trl's one-message list."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, str):
        value = {"role": "assistant", "content": value}
    if not isinstance(value, dict):
        raise RowError(f"{where} is {type(value).__name__}, expected a string or an assistant message")
    if value.get("role", "assistant") != "assistant":
        raise RowError(f"{where} has role {value.get('role')!r}; a reply is an assistant message")
    # The chat validator checks the content (non-empty string) and any tool calls.
    return validate_chat_row({"messages": [{**value, "role": "assistant"}]})["messages"][0]


def prompt_messages(value: Any, where: str) -> list[dict]:
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RowError(f"{where} is {type(value).__name__ if value is not None else 'missing'}, expected a "
                       "string or a non-empty list of messages")
    # Validated as a chat, with a stand-in reply so a prompt without assistant turns passes.
    messages = validate_chat_row({"messages": value + [{"role": "assistant", "content": "-"}]})["messages"][:-1]
    if messages[-1]["role"] == "assistant":
        raise RowError(f"{where} ends with an assistant turn; the prompt ends where the replies begin")
    return messages


def validate_preference_row(row: Any) -> dict:
    """{"messages": prompt, "chosen": message, "rejected": message} from any accepted layout."""
    if not isinstance(row, dict):
        raise RowError(f"row is {type(row).__name__}, expected a JSON object")
    if "rejected_response" in row:  # ms-swift: the chosen reply is the conversation's last turn
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict) \
                or messages[-1].get("role") != "assistant":
            raise RowError("an ms-swift row's 'messages' must end with the chosen assistant reply")
        prompt, chosen = prompt_messages(messages[:-1], "messages"), _reply(messages[-1], "messages[-1]")
        rejected = _reply(row["rejected_response"], "rejected_response")
    elif "chosen" in row and "rejected" in row:
        key = "messages" if "messages" in row else "prompt"
        prompt = prompt_messages(row.get(key), key)
        chosen, rejected = _reply(row["chosen"], "chosen"), _reply(row["rejected"], "rejected")
    else:
        raise RowError(f"row has keys {sorted(row)}; a preference row needs 'messages' (or 'prompt') with "
                       "'chosen' and 'rejected', or ms-swift's 'messages' with 'rejected_response'")
    if chosen == rejected:
        raise RowError("chosen and rejected replies are identical: the pair prefers nothing")
    normalised = {"messages": prompt, "chosen": chosen, "rejected": rejected}
    for key in REFERENCE_KEYS:  # a row written back by the reference task keeps its log-probs
        if key in row:
            normalised[key] = float(row[key])
    return normalised


def _final_reply_only(labels: list[int]) -> list[int]:
    """Keep the last contiguous labelled span (the final reply); earlier assistant turns become context."""
    end = len(labels)
    while end > 0 and labels[end - 1] == IGNORE_INDEX:
        end -= 1
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return [IGNORE_INDEX] * start + labels[start:end] + [IGNORE_INDEX] * (len(labels) - end)


def encode_preference_row(tokenizer, row: dict, enable_thinking: bool = True) -> dict:
    """Token ids and labels of prompt + chosen and of prompt + rejected (labels on that reply only)."""
    example = {}
    for side in SIDES:
        encoded = encode_chat(tokenizer, row["messages"] + [row[side]], enable_thinking=enable_thinking)
        example[f"{side}_input_ids"] = encoded["input_ids"]
        example[f"{side}_labels"] = _final_reply_only(encoded["labels"])
    for key in REFERENCE_KEYS:
        if key in row:
            example[key] = row[key]
    return example


def truncate_preference(example: dict, max_length: int) -> dict:
    out = dict(example)
    for side in SIDES:
        out[f"{side}_input_ids"] = example[f"{side}_input_ids"][:max_length]
        out[f"{side}_labels"] = example[f"{side}_labels"][:max_length]
    return out


def was_truncated(example: dict, max_length: int) -> bool:
    return any(len(example[f"{side}_input_ids"]) > max_length for side in SIDES)


def count_preference_tokens(example: dict) -> tuple[int, int]:
    """(tokens of both sequences, their labelled reply tokens); 0 labelled when either reply has none left
    (truncation can cut a long prompt's reply away), so the row counts as bad."""
    trained = [count_trained_tokens(example[f"{side}_labels"]) for side in SIDES]
    return sum(len(example[f"{side}_input_ids"]) for side in SIDES), sum(trained) if min(trained) else 0


def _with_pair_fields(batch: dict, examples: list[dict]) -> dict[str, torch.Tensor]:
    """`batch` with which pairs count (`pair_valid`) and the precomputed reference log-probs when every example
    has them."""
    # A rank's stand-in pair (the short last micro-batch, twinkle_core.parallel.data) runs but counts for nothing.
    batch["pair_valid"] = torch.tensor([not e.get("masked", False) for e in examples])
    for key in REFERENCE_KEYS:
        if all(key in e for e in examples):
            batch[key] = torch.tensor([e[key] for e in examples], dtype=torch.float32)
    return batch


def collate_preferences(examples: list[dict], pad_token_id: int | None, mask_dtype: torch.dtype = torch.float32,
                        ) -> dict[str, torch.Tensor]:
    """One padded batch of 2n rows: the n chosen sequences, then the n rejected ones (row i and n + i are a
    pair), which pairs count (`pair_valid`), and the precomputed reference log-probs when every example has
    them."""
    sequences = [{"input_ids": e[f"{side}_input_ids"], "labels": e[f"{side}_labels"]}
                 for side in SIDES for e in examples]
    batch = collate(sequences, pad_token_id=pad_token_id, mask_dtype=mask_dtype)
    return _with_pair_fields(batch, examples)


def collate_preferences_padding_free(examples: list[dict]) -> dict[str, torch.Tensor]:
    """The 2n sequences end to end in one row (twinkle_core.data.PaddingFreeRow), chosen ones first: each rejected
    sequence holds only what follows its pair's shared prompt and attends to that prompt in its chosen sequence.
    Sample i and n + i are a pair; `pair_valid` and reference log-probs as in collate_preferences."""
    row = PaddingFreeRow()
    sides = [({"input_ids": e["chosen_input_ids"], "labels": e["chosen_labels"]},
              {"input_ids": e["rejected_input_ids"], "labels": e["rejected_labels"]}) for e in examples]
    begins = [row.add(chosen) for chosen, _ in sides]
    for begin, (chosen, rejected) in zip(begins, sides):
        row.add(rejected, (begin, shared_prefix_length([chosen, rejected])))
    batch = row.batch()
    return _with_pair_fields(batch, examples)
