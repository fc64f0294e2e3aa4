"""Pack several encoded examples into one sequence, keeping samples from seeing or predicting each other."""
from __future__ import annotations

from .encode import IGNORE_INDEX


def _append(packed: dict, example: dict) -> None:
    labels = list(example["labels"])
    # With the causal shift, a sample's first label would be predicted from the previous sample's last token.
    labels[0] = IGNORE_INDEX
    packed["input_ids"].extend(example["input_ids"])
    packed["labels"].extend(labels)
    packed["position_ids"].extend(range(len(example["input_ids"])))


def pack_groups(lengths: list[int], max_length: int) -> list[list[int]]:
    """Indices of the examples each packed sequence holds: in order, greedy next-fit, at most `max_length`
    tokens each."""
    if max_length < 1:
        raise ValueError(f"max_length={max_length} must be a positive number of tokens")
    groups: list[list[int]] = []
    used = 0
    for index, length in enumerate(lengths):
        if length == 0 or length > max_length:
            raise ValueError(
                f"example {index} has {length} tokens; packing needs 1..max_length={max_length} "
                "(truncate examples before packing)"
            )
        if not groups or used + length > max_length:
            groups.append([])
            used = 0
        groups[-1].append(index)
        used += length
    return groups


def pack_examples(examples: list[dict], max_length: int) -> list[dict]:
    """Concatenate examples in order into sequences of at most `max_length` tokens (greedy next-fit).

    Each packed sequence has input_ids, labels and position_ids; position_ids restart at 0 for each
    sample, which is how collate (and flash-attention kernels) find the sample boundaries.
    """
    groups = pack_groups([len(example["input_ids"]) for example in examples], max_length)
    return [concat_samples([examples[index] for index in group]) for group in groups]


def concat_samples(samples: list[dict]) -> dict:
    """One packed sequence of `samples` (input_ids, labels, position_ids restarting at 0 for each)."""
    packed: dict = {"input_ids": [], "labels": [], "position_ids": []}
    for sample in samples:
        _append(packed, sample)
    return packed
