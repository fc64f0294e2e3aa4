"""Batch encoded examples into padded tensors."""
from __future__ import annotations

import torch

from .encode import IGNORE_INDEX


def _pad(rows: list[list[int]], length: int, value: int) -> torch.Tensor:
    return torch.tensor([list(row) + [value] * (length - len(row)) for row in rows], dtype=torch.long)


def block_causal_mask(position_ids: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive [B, 1, T, T] mask: each token sees earlier tokens of its own sample only.

    Samples start where position_ids is 0. sdpa and eager attention take a 4D mask as is and do not
    infer sample boundaries from position_ids themselves. Padding tokens see only themselves, so no
    softmax row is empty (an all-masked row gives NaN).
    """
    batch, length = position_ids.shape
    steps = torch.arange(length)
    valid = steps[None, :] < lengths[:, None]
    sample = torch.cumsum(position_ids == 0, dim=-1)
    sample = torch.where(valid, sample, -1 - steps[None, :])
    allowed = (sample[:, :, None] == sample[:, None, :]) & (steps[None, :, None] >= steps[None, None, :])
    mask = torch.zeros(batch, length, length, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def collate(
    examples: list[dict],
    pad_token_id: int | None,
    pad_to_multiple_of: int | None = None,
    mask_dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Right-pad a batch: input_ids with pad_token_id, labels with -100.

    Plain examples get a [B, T] attention_mask. Packed examples (with position_ids) get position_ids and
    a [B, 1, T, T] block-diagonal causal mask of `mask_dtype` (pass the model's dtype: sdpa rejects a float
    mask of another dtype). Flash-attention models should drop that mask and rely on position_ids.
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    if pad_token_id is None:
        raise ValueError("pad_token_id is None; set tokenizer.pad_token (e.g. to the eos token) before batching")
    packed = ["position_ids" in example for example in examples]
    if any(packed) and not all(packed):
        raise ValueError("a batch mixes packed examples (with position_ids) and plain ones; pack all or none")
    lengths = torch.tensor([len(example["input_ids"]) for example in examples])
    length = int(lengths.max())
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    batch = {
        "input_ids": _pad([e["input_ids"] for e in examples], length, pad_token_id),
        "labels": _pad([e["labels"] for e in examples], length, IGNORE_INDEX),
    }
    if all(packed):
        for index, example in enumerate(examples):
            first = example["position_ids"][0]
            if first != 0:
                raise ValueError(f"packed example {index} has position_ids starting at {first}; samples start at 0")
        batch["position_ids"] = _pad([e["position_ids"] for e in examples], length, 0)
        batch["attention_mask"] = block_causal_mask(batch["position_ids"], lengths, mask_dtype)
    else:
        batch["attention_mask"] = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return batch


def shared_prefix_length(examples: list[dict]) -> int:
    """How many leading tokens all `examples` share without training on them: the longest common prefix of their
    input_ids such that no label in it, nor the label right after it, is a target (nothing is predicted from a
    shared position), leaving each example at least one token of its own. 0 for fewer than two examples or for
    packed ones (with position_ids)."""
    if len(examples) < 2 or any(example.get("position_ids") is not None for example in examples):
        return 0
    first = examples[0]["input_ids"]
    shared = len(first)
    for example in examples:
        ids, labels = example["input_ids"], example["labels"]
        limit, common = min(shared, len(ids) - 1), 0
        while common < limit and ids[common] == first[common]:
            common += 1
        trained = next((index for index, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
        shared = min(common, trained - 1)
        if shared <= 0:
            return 0
    return shared


class PaddingFreeRow:
    """Samples laid end to end in one row, each optionally continuing a prefix already in the row.

    A sample that continues the `length` tokens at `start` (its own first `length` tokens, equal to those) holds
    only the tokens after them, its positions going on from `length`; the attention (`twinkle_sdpa`) lets it
    attend to that span as if it came first. Causal attention makes the span's states the same in every sample
    that shares it, so the loss and gradients are those of the whole samples (to rounding)."""

    def __init__(self):
        self.input_ids: list[int] = []
        self.labels: list[int] = []
        self.positions: list[int] = []
        self.starts: list[int] = []
        self.prefixes: list[tuple[int, int]] = []  # per sample: (start, length) of the span it continues

    def add(self, example: dict, prefix: tuple[int, int] = (0, 0)) -> int:
        """Append `example` (continuing `prefix`); return where its tokens begin in the row."""
        begin, skip = len(self.input_ids), prefix[1]
        ids = list(example["input_ids"])[skip:]
        own = example.get("position_ids")
        own = list(range(skip, skip + len(ids))) if own is None else list(own)
        labels = list(example["labels"])[skip:]
        for offset, position in enumerate(own):
            if position == 0 or (skip and offset == 0):  # a sample's first target would come from another one
                labels[offset] = IGNORE_INDEX
                self.starts.append(begin + offset)
                self.prefixes.append(prefix if position else (0, 0))
        self.input_ids += ids
        self.labels += labels
        self.positions += own
        return begin

    def batch(self) -> dict[str, torch.Tensor]:
        position_ids = torch.tensor([self.positions], dtype=torch.long)
        batch = {"input_ids": torch.tensor([self.input_ids], dtype=torch.long),
                 "labels": torch.tensor([self.labels], dtype=torch.long),
                 "position_ids": position_ids,
                 "attention_mask": torch.ones_like(position_ids),
                 "cu_seq_lens_q": torch.tensor(self.starts + [len(self.positions)], dtype=torch.int32)}
        if any(length for _, length in self.prefixes):
            batch["prefix_spans"] = torch.tensor(self.prefixes, dtype=torch.int32)
        return batch


def collate_padding_free(examples: list[dict], share_prefix: bool = True) -> dict[str, torch.Tensor]:
    """One row of every sample laid end to end, with no padding (what the `twinkle_sdpa` attention takes).

    Plain and packed examples alike: position_ids restart at 0 for each sample, `cu_seq_lens_q` holds the
    sample boundaries (int32 offsets, the flash-attention name) and the attention mask is all ones. Each
    sample's first label is dropped (-100): with the causal shift it would be predicted from the previous
    sample's last token, and in a padded batch it is never a target either. The loss equals that of
    `collate`'s padded batch on the same examples.

    `share_prefix`: plain examples that begin with the same untrained tokens (a chat template's system prompt,
    shared tool schemas) keep that prefix once: the first sample is whole and every later one continues its
    first `shared_prefix_length(examples)` tokens (`prefix_spans`, PaddingFreeRow), so every layer runs over
    fewer tokens for the same loss.
    """
    if not examples:
        raise ValueError("collate_padding_free needs at least one example")
    shared = shared_prefix_length(examples) if share_prefix else 0
    row = PaddingFreeRow()
    for index, example in enumerate(examples):
        row.add(example, (0, shared) if index else (0, 0))
    return row.batch()
